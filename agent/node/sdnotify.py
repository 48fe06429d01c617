"""systemd's notification protocol (``sd_notify``): datagrams of ``KEY=VALUE`` lines.

systemd puts the address of its notification socket in ``NOTIFY_SOCKET`` (a path, or ``@name``
for an abstract socket) and, with ``WatchdogSec=``, the watchdog period in ``WATCHDOG_USEC`` (and
the pid it applies to in ``WATCHDOG_PID``). ``Notifier.from_environ`` reads them and takes them out
of the environment, so the engines the agent starts never talk to systemd in its place (a vLLM that
learns ``READY=1`` must not tell systemd the service is ready while the agent still proves it).

Sending never blocks and never fails the agent: the socket is non-blocking, a message that cannot
be sent is dropped, and each kind of error is logged once. Without ``NOTIFY_SOCKET`` every send is
a no-op. What the agent says and when is ``agent.node.servicenotes`` (docs/systemd.md).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"
# systemd reads at most this much of one datagram; a STATUS= sentence is cut to fit.
MAX_STATUS_CHARS = 1024


def socket_address(value: str) -> str | bytes:
    """The ``sendto`` address of a ``NOTIFY_SOCKET`` value: a path, or ``@name`` (abstract)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_seconds(environ: MutableMapping[str, str], pid: int) -> float | None:
    """The watchdog period in seconds, or None when there is none for process ``pid``."""
    usec = environ.get(WATCHDOG_USEC, "").strip()
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get(WATCHDOG_PID, "").strip()
    if owner and owner != str(pid):
        return None  # meant for another process (an agent started by one that was notified)
    return int(usec) / 1_000_000


class Notifier:
    """Sends ``sd_notify`` messages to one socket (or nowhere, when systemd gave none)."""

    def __init__(
        self, address: str | None, *, watchdog_s: float | None, log: logging.Logger
    ) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self.log = log
        self._sock: socket.socket | None = None
        self._errors_logged: set[str] = set()
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(
        cls, log: logging.Logger, environ: MutableMapping[str, str] | None = None
    ) -> Notifier:
        """The notifier systemd asked for (none without ``NOTIFY_SOCKET``); the variables are
        removed from ``environ`` (default: this process's), so no child inherits them."""
        env = os.environ if environ is None else environ
        address = env.get(NOTIFY_SOCKET, "").strip() or None
        watchdog_s = watchdog_seconds(env, os.getpid()) if address else None
        for name in (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID):
            env.pop(name, None)
        return cls(address, watchdog_s=watchdog_s, log=log)

    @property
    def enabled(self) -> bool:
        """Whether systemd listens (``NOTIFY_SOCKET`` was set)."""
        return self._sock is not None

    def send(self, **fields: str) -> bool:
        """One datagram of ``KEY=VALUE`` lines (``send(READY="1", STATUS="...")``); whether it
        left. Values are made one line: a newline would start another field."""
        if self._sock is None or self.address is None:
            return False
        lines = [f"{key}={' '.join(str(value).splitlines())}" for key, value in fields.items()]
        try:
            self._sock.sendto("\n".join(lines).encode(), socket_address(self.address))
        except OSError as exc:
            kind = type(exc).__name__ + str(exc.errno)
            if kind not in self._errors_logged:
                self._errors_logged.add(kind)
                self.log.warning(
                    "cannot notify systemd at %s (%s); the agent carries on, systemd may time "
                    "the unit out: check NOTIFY_SOCKET and NotifyAccess=main",
                    self.address,
                    exc.strerror or exc,
                )
            return False
        return True

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
