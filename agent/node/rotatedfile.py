"""An engine's log file, rotated by size, each file with its receive-times index
(``engine.times``, ``agent.job.logtimes``) moving with it.

Written from a worker thread (``agent.node.logpump``: a stalled shared file system must not stall
the loop), so every method takes the file's lock: the loop's ``close`` may come while a write
works. Rotation is between lines: a line that would take ``path`` past ``max_bytes`` goes, whole,
into a fresh file after ``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest is
deleted); a single line larger than ``max_bytes`` gets a file of its own.
"""

import errno
import os
import threading
from pathlib import Path

from agent.job.logtimes import TimesWriter, times_path
from agent.job.paths import PRIVATE_DIR_MODE

_IOV_MAX = 1024  # buffers per writev (Linux's limit)


class RotatedFile:
    """``path`` and its rotated backups; opened at the first write."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._file_lock = threading.Lock()
        self._fd: int | None = None
        self._times = TimesWriter()
        self._size = 0

    def write(self, blocks: list[tuple[bytes, float]]) -> OSError | None:
        """Append (block, received at) to the file, rotating between lines; the error that
        refused them, if any (the file is closed then, and reopened by the next write)."""
        with self._file_lock:
            try:
                if self._fd is None:
                    self._open()
                if sum(len(block) for block, _ in blocks) <= self.max_bytes - self._size:
                    # One system call for the batch: each call gives the GIL up, and taking it
                    # back while the loop's thread reads the pipe can take a switch interval.
                    # The times go into the index before the bytes: a reader that sees them
                    # finds them.
                    offset = self._size
                    for block, received in blocks:
                        self._times.add(offset, received)
                        offset += len(block)
                    self._write_all([block for block, _ in blocks])
                else:
                    for block, received in blocks:
                        self._write_block(block, received)
            except OSError as exc:
                self._close_fd()
                return exc
        return None

    def _write_block(self, block: bytes, received: float) -> None:
        """Append whole lines; rotate before a line that would not fit."""
        if self._fd is None:
            self._open()
        while block:
            room = self.max_bytes - self._size
            # The time goes into the index before the bytes: a reader that sees them finds it.
            self._times.add(self._size, received)
            if len(block) <= room:
                self._write_all([block])
                return
            cut = block.rfind(b"\n", 0, room) + 1 if room > 0 else 0
            if cut == 0 and self._size == 0:
                cut = block.find(b"\n") + 1 or len(block)
            if cut:
                self._write_all([block[:cut]])
                block = block[cut:]
            if block:
                self._rotate()

    def _write_all(self, buffers: list[bytes]) -> None:
        """``os.writev`` until every byte is written (one system call, as a rule)."""
        fd = self._fd
        if fd is None:  # _write_block opens the file first; a closed sink writes nothing
            raise OSError(errno.EBADF, "the log file is closed", str(self.path))
        views = [memoryview(b) for b in buffers if b]
        while views:
            done = os.writev(fd, views[:_IOV_MAX])
            self._size += done
            while views and done >= len(views[0]):
                done -= len(views.pop(0))
            if done:
                views[0] = views[0][done:]

    def _open(self) -> None:
        """Open (append) the current file, creating the agent's private log folder."""
        self.path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._times.open(self.path, self._fd)

    def _rotate(self) -> None:
        """``path`` -> ``path.1`` -> ... -> ``path.<backups>``, then a fresh ``path``.

        Each file's times index (``engine.times``) moves with it.
        """
        self._close_fd()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            times_path(self.path).unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                newer = self.path.with_name(f"{self.path.name}.{i + 1}")
                if older.exists():
                    os.replace(older, newer)
                if times_path(older).exists():
                    os.replace(times_path(older), times_path(newer))
            if self.path.exists():
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            if times_path(self.path).exists():
                os.replace(
                    times_path(self.path), times_path(self.path.with_name(f"{self.path.name}.1"))
                )
        self._open()

    def _close_fd(self) -> None:
        """Close the file (and its times index) if open."""
        self._times.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Close the file (a later write reopens it)."""
        with self._file_lock:
            self._close_fd()
