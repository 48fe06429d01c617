"""Reading log files onward: tail, follow across rotation (``tilert-submit logs`` and ``/logs``)."""

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import BinaryIO

import trio

# ---- reading logs ----

_FOLLOW_READ = 1024 * 1024
_FOLLOW_MAX_LINE = 1024 * 1024


def _tail_offset(f: BinaryIO, n: int) -> int:
    """The offset where the last ``n`` lines of ``f`` start (a partial last line counts as one)."""
    end = f.seek(0, os.SEEK_END)
    if n <= 0 or end == 0:
        return end
    f.seek(end - 1)
    needed = n + 1 if f.read(1) == b"\n" else n
    pos = end
    while pos > 0:
        step = min(64 * 1024, pos)
        pos -= step
        f.seek(pos)
        block = f.read(step)
        i = len(block)
        while (i := block.rfind(b"\n", 0, i)) >= 0:
            needed -= 1
            if needed == 0:
                return pos + i + 1
    return 0


class LogFollower:
    """Reads one log file onward across rotation, truncation and a file that does not exist yet."""

    def __init__(self, path: Path, *, tail_lines: int | None = None) -> None:
        self.path = path
        self._tail = tail_lines
        self._f: BinaryIO | None = None
        self._ino = -1
        self._partial = b""
        self._first_open = True

    def poll(self) -> tuple[list[str], bool]:
        """One blocking step: new complete lines, and whether more may be readable right away."""
        if self._f is None and not self._open():
            return [], False
        assert self._f is not None
        data = self._f.read(_FOLLOW_READ)
        if data:
            return self._lines(data), len(data) == _FOLLOW_READ
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return [], False  # renamed away, the new file is not there yet: keep the old one
        if st.st_ino != self._ino:
            # Rotated: whatever the writer put in the old file before the rename comes first.
            rest = self._f.read()
            lines = self._lines(rest) + self._flush()
            self._f.close()
            self._f = None
            return lines, True
        if st.st_size < self._f.tell():
            self._f.seek(0)
            return self._flush(), True
        return [], False

    def close(self) -> None:
        """Close the file."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def finish(self) -> list[str]:
        """Everything still readable, then the partial last line; closes the file."""
        lines = list(self.drain())
        lines.extend(self._flush())
        self.close()
        return lines

    def drain(self) -> Iterator[str]:
        """Blocking: every line readable now (for printing history without following)."""
        while True:
            lines, more = self.poll()
            yield from lines
            if not more:
                return

    async def batches(
        self, *, poll_s: float = 0.2, stop: trio.Event | None = None
    ) -> AsyncIterator[list[str]]:
        """Batches of new lines as they are appended, until ``stop`` is set (then a last read)."""
        try:
            while True:
                lines, more = await trio.to_thread.run_sync(self.poll)
                if lines:
                    yield lines
                if more:
                    continue
                if stop is not None and stop.is_set():
                    last = await trio.to_thread.run_sync(self.finish)
                    if last:
                        yield last
                    return
                with trio.move_on_after(poll_s):
                    if stop is None:
                        await trio.sleep_forever()
                    await stop.wait()
        finally:
            self.close()

    def _open(self) -> bool:
        """Open the file if it exists, at the tail position the first time, else at its start."""
        first, self._first_open = self._first_open, False
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
        except FileNotFoundError:
            return False
        self._ino = os.fstat(f.fileno()).st_ino
        if first and self._tail is not None:
            f.seek(_tail_offset(f, self._tail))
        self._f = f
        return True

    def _lines(self, data: bytes) -> list[str]:
        """Complete lines of ``self._partial + data``; the rest waits for its newline."""
        buf = self._partial + data
        parts = buf.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > _FOLLOW_MAX_LINE:
            parts.append(self._partial)
            self._partial = b""
        return [p.decode("utf-8", "replace").rstrip("\r") for p in parts]

    def _flush(self) -> list[str]:
        """The partial last line, as a line (the file ended or was replaced)."""
        if not self._partial:
            return []
        line, self._partial = self._partial, b""
        return [line.decode("utf-8", "replace").rstrip("\r")]


async def follow_file(
    path: Path,
    *,
    tail_lines: int | None = None,
    poll_s: float = 0.2,
    stop: trio.Event | None = None,
) -> AsyncIterator[str]:
    """Yield complete lines: the last ``tail_lines`` (all when None), then new ones, until ``stop``.

    Survives rotation (``path`` renamed to ``path.1``, a new ``path`` created) and a file that does
    not exist yet (waits for it; a file created later is read from its start). Close the generator
    with ``contextlib.aclosing`` when you stop early.
    """
    async for batch in LogFollower(path, tail_lines=tail_lines).batches(poll_s=poll_s, stop=stop):
        for line in batch:
            yield line
