"""When each engine line was received: a side index next to each log file (``engine.times``).

The engine log keeps exactly the bytes the engine wrote (people ``grep`` and ``tail -F`` it, and
the engines' own timestamps, when they have any, come in many formats), so the time the agent
received each line lives beside it, in a small binary file of its own:

- ``engine.log`` -> ``engine.times``, ``engine.log.1`` -> ``engine.times.1``, ... (``router.log`` ->
  ``router.times``): the index rotates together with its log file;
- a 16-byte header, ``TLTIMES1`` and the inode of the log file it describes (little-endian
  unsigned 64 bits), so a reader never pairs a log file with another file's index after a
  rotation;
- then 16-byte records ``<offset, time>`` (``<Qd``): the bytes of the log file from ``offset`` on
  were received at ``time`` (Unix seconds), until the next record. One record per batch of output
  the agent read at once, at most one per millisecond, written before the bytes it describes, so
  a reader that sees a line can always find its time.

A reader without an index (a file written by an older agent, or another file) gets no times:
lines show ``-`` for ``--timestamps``. ``tilert-submit logs --since`` and ``--timestamps`` and the
agent's ``/logs?since=...&timestamps=1`` read the index.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
import time
from array import array
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

MAGIC = b"TLTIMES1"
_HEADER = struct.Struct("<8sQ")
_RECORD = struct.Struct("<Qd")
HEADER_SIZE = _HEADER.size
RECORD_SIZE = _RECORD.size
_LOG_NAME = re.compile(r"^(?P<stem>.+)\.log(?P<rotation>\.\d+)?$")


def times_path(log: Path) -> Path:
    """The index of log file ``log``: ``engine.log.2`` -> ``engine.times.2``."""
    match = _LOG_NAME.match(log.name)
    if match is None:
        return log.with_name(log.name + ".times")
    return log.with_name(f"{match['stem']}.times{match['rotation'] or ''}")


def format_time(t: float) -> str:
    """ISO 8601 in UTC with milliseconds, like ``agent.log``: ``2026-12-02T11:22:33.123Z``."""
    ms = int(t * 1000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000))
    return f"{stamp}.{ms % 1000:03d}Z"


def parse_time(line: str) -> float | None:
    """The time at the start of an ``agent.log`` line (``format_time``'s form), else None."""
    if len(line) < 24 or line[23] != "Z" or line[10] != "T":
        return None
    try:
        return datetime.fromisoformat(line[:23] + "+00:00").timestamp()
    except ValueError:
        return None


class TimesWriter:
    """Appends records for one log file; used by the log pump's writer thread only."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._last_ms = -1

    def open(self, log: Path, log_fd: int) -> None:
        """Start (or continue) the index of the log file open as ``log_fd``."""
        self.close()
        try:
            ino = os.fstat(log_fd).st_ino
            fd = os.open(
                times_path(log), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
        except OSError:
            return  # best effort: the log itself matters more than its times
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
            if len(header) < HEADER_SIZE or _HEADER.unpack(header) != (MAGIC, ino):
                # Another file's index (or a torn one): this log file starts a fresh index.
                os.ftruncate(fd, 0)
                os.write(fd, _HEADER.pack(MAGIC, ino))
        except OSError:
            os.close(fd)
            return
        self._fd = fd
        self._last_ms = -1

    def add(self, offset: int, t: float) -> None:
        """Bytes from ``offset`` on were received at ``t`` (skipped within the same millisecond)."""
        ms = int(t * 1000)
        if self._fd is None or ms == self._last_ms:
            return
        self._last_ms = ms
        try:
            os.write(self._fd, _RECORD.pack(offset, t))
        except OSError:
            self.close()  # until the log file is opened again

    def close(self) -> None:
        """Close the index file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TimesReader:
    """The receive times of one open log file (found by its inode), refreshed as it grows."""

    def __init__(self, log: Path, ino: int) -> None:
        self._log = log
        self._ino = ino
        # Arrays, not lists: a busy engine's file may hold millions of records.
        self._offsets = array("Q")
        self._times = array("d")
        self._f = _open_index(log, ino)
        self._rest = b""
        self._closed = False
        self.refresh()

    @property
    def found(self) -> bool:
        """Whether the log file's index has been found."""
        return self._f is not None

    def refresh(self) -> None:
        """Read the records appended since the last call."""
        if self._f is None and not self._closed:
            # Right after a rotation the writer creates the index just after the log file.
            self._f = _open_index(self._log, self._ino)
        if self._f is None:
            return
        data = self._rest + self._f.read()
        whole = len(data) - len(data) % RECORD_SIZE
        self._rest = data[whole:]
        last = self._times[-1] if self._times else float("-inf")
        for offset, t in _RECORD.iter_unpack(data[:whole]):
            # A wall clock that stepped back must not break the order --since searches in.
            last = max(last, t)
            self._offsets.append(offset)
            self._times.append(last)

    def time_at(self, offset: int) -> float | None:
        """When the byte at ``offset`` was received, as of the last ``refresh`` (None: unknown).

        The writer writes a record before its bytes, so a refresh after reading the bytes finds
        it (another client of a network file system may see the bytes first: the line then
        gets the time of the batch before it).
        """
        i = bisect.bisect_right(self._offsets, offset) - 1
        return self._times[i] if i >= 0 else None

    def offset_since(self, t: float) -> int | None:
        """The first offset received at or after ``t``; None when nothing was (or no index)."""
        self.refresh()
        i = bisect.bisect_left(self._times, t)
        return self._offsets[i] if i < len(self._offsets) else None

    def close(self) -> None:
        """Close the index file."""
        self._closed = True
        if self._f is not None:
            self._f.close()
            self._f = None


def _open_index(log: Path, ino: int) -> BinaryIO | None:
    """The index file whose header names inode ``ino``, positioned after the header, or None."""
    own = times_path(log)
    stem = _LOG_NAME.match(log.name)
    candidates = [own]
    if stem is not None:
        # After a rotation the index may already carry the next number.
        candidates += sorted(log.parent.glob(f"{stem['stem']}.times.*"))
    for path in candidates:
        try:
            f = open(path, "rb")  # noqa: SIM115 - kept open while the log is read
        except OSError:
            continue
        header = f.read(HEADER_SIZE)
        if len(header) == HEADER_SIZE and _HEADER.unpack(header) == (MAGIC, ino):
            return f
        f.close()
    return None
