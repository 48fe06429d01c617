"""systemd's socket activation (``sd_listen_fds``): the service front's listening socket, inherited.

With ``systemd/tilert-service.socket`` systemd holds the service's address itself: it listens
before the service front starts, and keeps listening while the front restarts, so a client
connecting meanwhile waits in the backlog instead of being refused (docs/service.md, "Under
systemd"). systemd passes the socket as file descriptor 3 (``SD_LISTEN_FDS_START``) and says so in
``LISTEN_FDS`` (how many) and ``LISTEN_PID`` (the process they are meant for: a child that
inherits the environment must not take them too). The variables are removed once read.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

from agent.problems import InputError, error

LISTEN_FDS = "LISTEN_FDS"
LISTEN_PID = "LISTEN_PID"
LISTEN_FDNAMES = "LISTEN_FDNAMES"
# The first descriptor systemd passes (sd-daemon.h's SD_LISTEN_FDS_START).
SD_LISTEN_FDS_START = 3
_WHERE = "LISTEN_FDS (systemd socket activation)"
_FIX = (
    "give the service front one listening TCP socket: one ListenStream= in tilert-service.socket "
    "(docs/service.md)"
)


def _take(environ: MutableMapping[str, str], pid: int) -> int:
    """How many descriptors systemd passed to process ``pid`` (0: none, or not for it); the
    variables are removed either way."""
    count = environ.get(LISTEN_FDS, "").strip()
    owner = environ.get(LISTEN_PID, "").strip()
    for name in (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES):
        environ.pop(name, None)
    if not count or owner != str(pid):
        return 0
    if not count.isdigit():
        raise InputError([error(_WHERE, f"LISTEN_FDS={count!r} is not a count", _FIX)])
    return int(count)


def inherited_socket(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> socket.socket | None:
    """The listening socket systemd passed (fd 3), or None when it passed none to this process.

    ``InputError`` naming ``LISTEN_FDS`` when what was passed is not one listening stream
    socket. The socket is returned close-on-exec and non-blocking, ready for trio
    (``trio.socket.from_stdlib_socket``)."""
    env = os.environ if environ is None else environ
    count = _take(env, os.getpid() if pid is None else pid)
    if count == 0:
        return None
    if count != 1:
        raise InputError(
            [error(_WHERE, f"systemd passed {count} sockets; the service front takes one", _FIX)]
        )
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as exc:
        raise InputError(
            [error(_WHERE, f"fd {SD_LISTEN_FDS_START} is not a socket ({exc.strerror})", _FIX)]
        ) from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()  # not ours to close: leave the descriptor as it came
        raise InputError(
            [error(_WHERE, f"fd {SD_LISTEN_FDS_START} is not a listening stream socket", _FIX)]
        )
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


def address(sock: socket.socket) -> tuple[str, int]:
    """The host and port an inherited socket listens on (what service.json's front URL says)."""
    host, port = sock.getsockname()[:2]
    return str(host), int(port)
