"""A datagram socket in systemd's place: what an agent under ``NOTIFY_SOCKET`` tells systemd.

Each datagram is stamped by the kernel as it arrives (``SO_TIMESTAMPNS``), so a watchdog's pace is
read as the agent sent it, not as a busy test thread got round to reading it. Imported from
``tests.kit.notifysocket``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agent.node.sdnotify import socket_address
from tests.kit.waiting import wait_for

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python does not name it


@dataclass(frozen=True)
class Note:
    """One datagram: when the kernel received it (wall clock) and its fields."""

    at: float
    fields: dict[str, str]


class Listener:
    """A datagram socket in systemd's place; a thread collects every note it receives."""

    def __init__(self, address: str) -> None:
        self.address = address  # the NOTIFY_SOCKET value: a path, or @name (abstract)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(address))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.settimeout(0.2)
        self.notes: list[Note] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._done.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, 64)
            except TimeoutError:
                continue
            except OSError:
                return
            stamp = next(
                (
                    sec + nsec / 1e9
                    for _, kind, raw in ancillary
                    if kind == SO_TIMESTAMPNS
                    for sec, nsec in [struct.unpack("qq", raw[:16])]
                ),
                0.0,
            )
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.notes.append(Note(stamp, fields))

    def seen(self) -> list[Note]:
        """Every note so far, in the order received."""
        with self._lock:
            return list(self.notes)

    def with_key(self, key: str) -> list[Note]:
        """The notes carrying ``key``."""
        return [n for n in self.seen() if key in n.fields]

    def wait(self, what: str, check: Callable[[list[Note]], bool], timeout: float) -> list[Note]:
        """Every note, once ``check(notes)`` holds (bounded)."""
        return wait_for(
            what,
            self.seen,
            timeout,
            until=check,
            detail=lambda: "\n".join(str(n.fields) for n in self.seen()[-20:]),
        )

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._done.set()
        self._thread.join(5)
        self.sock.close()


@contextlib.contextmanager
def listening(address: str) -> Iterator[Listener]:
    """A ``Listener`` on ``address``, closed on exit."""
    listener = Listener(address)
    try:
        yield listener
    finally:
        listener.close()


def abstract_address() -> str:
    """A fresh abstract socket name (no file to clean up)."""
    return f"@tilert-test-{uuid.uuid4().hex}"


def index_of(notes: list[Note], key: str, value: str | None = None) -> int:
    """The position of the first note with ``key`` (and ``value``), or -1."""
    for i, note in enumerate(notes):
        if key in note.fields and (value is None or value in note.fields[key]):
            return i
    return -1


def pets_after(notes: list[Note], start: int) -> list[float]:
    """The kernel receive times of the pets from note ``start`` on."""
    return [n.at for n in notes[start:] if "WATCHDOG" in n.fields]
