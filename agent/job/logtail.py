"""Reading log files onward: history, tail, since, follow across rotation (``logs`` and ``/logs``).

``tilert-submit logs`` (on the job directory) and the agent's ``/logs`` (for node-local logs) read
through this one module, so both print the same lines for the same options. Each line comes with
the time it was received (``LogLine.time``): from the file's times index for engine logs
(``agent.job.logtimes``), from the line's own ISO prefix for ``agent.log``, or None when unknown.
"""

from __future__ import annotations

import enum
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import msgspec

from agent.job.logfiles import AGENT_LOG, rotated_files
from agent.job.logtimes import TimesReader, format_time, parse_time

if TYPE_CHECKING:
    import trio

_FOLLOW_READ = 1024 * 1024
_FOLLOW_MAX_LINE = 1024 * 1024
_HISTORY_BATCH = 4096


class LogLine(NamedTuple):
    """One line of a log file and when it was received (Unix seconds; None when unknown)."""

    time: float | None
    text: str


class Clock(enum.Enum):
    """Where a file's line times come from."""

    NONE = "none"  # nobody asked for times: the cheapest
    INDEX = "index"  # the side index the log pump writes (engine.log, router.log)
    PREFIX = "prefix"  # each line starts with its ISO time (agent.log)


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
    """Reads one log file onward across rotation, truncation and a file that does not exist yet.

    ``tail_lines``: start at the last N lines of the file as it is when first opened (None: at its
    start). ``since``: skip lines received before that time (Unix seconds); with an index the
    first open seeks straight to them, and lines whose time is unknown are kept. ``clock`` says
    where times come from (``Clock``); ``since`` needs one.
    """

    def __init__(
        self,
        path: Path,
        *,
        tail_lines: int | None = None,
        since: float | None = None,
        clock: Clock = Clock.NONE,
    ) -> None:
        self.path = path
        self._tail = tail_lines
        self.since = since
        self._clock = clock
        self._f: BinaryIO | None = None
        self._times: TimesReader | None = None
        self._ino = -1
        self._partial = b""
        self._pos = 0  # file offset of the first byte of ``_partial``
        self._first_open = True

    def sibling(self, path: Path) -> LogFollower:
        """A follower of another file (a rotated one) that reads alike, from its start."""
        return LogFollower(path, since=self.since, clock=self._clock)

    def poll(self) -> tuple[list[LogLine], bool]:
        """One blocking step: new complete lines, and whether more may be readable right away."""
        if self._f is None and not self._open():
            return [], False
        f = self._f
        if f is None:
            return [], False
        data = f.read(_FOLLOW_READ)
        if data:
            return self._lines(data), len(data) == _FOLLOW_READ
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return [], False  # renamed away, the new file is not there yet: keep the old one
        if st.st_ino != self._ino:
            # Rotated: whatever the writer put in the old file before the rename comes first.
            rest = f.read()
            lines = self._lines(rest) + self._flush()
            self.close()
            return lines, True
        if st.st_size < f.tell():
            lines = self._flush()
            f.seek(0)
            self._pos = 0
            return lines, True
        return [], False

    def close(self) -> None:
        """Close the file."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._times is not None:
            self._times.close()
            self._times = None

    def finish(self) -> list[LogLine]:
        """Everything still readable, then the partial last line; closes the file."""
        lines = list(self.drain())
        lines.extend(self._flush())
        self.close()
        return lines

    def drain(self) -> Iterator[LogLine]:
        """Blocking: every line readable now (for printing history without following)."""
        while True:
            lines, more = self.poll()
            yield from lines
            if not more:
                return

    async def batches(
        self, *, poll_s: float = 0.2, stop: trio.Event | None = None
    ) -> AsyncIterator[list[LogLine]]:
        """Batches of new lines as they are appended, until ``stop`` is set (then a last read)."""
        # Imported here: ``tilert-submit logs`` without -f (and ``--help``) never needs trio.
        import trio

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
        """Open the file if it exists: at tail/since the first time, else at its start."""
        first, self._first_open = self._first_open, False
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
        except FileNotFoundError:
            return False
        self._ino = os.fstat(f.fileno()).st_ino
        if self._clock == Clock.INDEX:
            self._times = TimesReader(self.path, self._ino)
        start = 0
        if first and self._tail is not None:
            start = _tail_offset(f, self._tail)
        if first and self.since is not None and self._times is not None and self._times.found:
            since_offset = self._times.offset_since(self.since)
            start = max(start, f.seek(0, os.SEEK_END) if since_offset is None else since_offset)
        f.seek(start)
        self._f = f
        self._pos = start
        self._partial = b""
        return True

    def _lines(self, data: bytes) -> list[LogLine]:
        """Complete lines of ``self._partial + data``; the rest waits for its newline."""
        buf = self._partial + data
        parts = buf.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > _FOLLOW_MAX_LINE:
            parts.append(self._partial)
            self._partial = b""
        if self._clock == Clock.NONE:
            self._pos += len(buf) - len(self._partial)
            return [LogLine(None, _text(p)) for p in parts]
        if self._times is not None:
            self._times.refresh()
        out = []
        for part in parts:
            line = self._line(self._pos, part)
            self._pos += len(part) + 1
            if line is not None:
                out.append(line)
        if not self._partial and parts and not buf.endswith(b"\n"):
            self._pos -= 1  # the over-long piece had no newline
        return out

    def _line(self, offset: int, raw: bytes) -> LogLine | None:
        """The line at ``offset`` with its time; None when it is older than ``since``."""
        text = _text(raw)
        if self._clock == Clock.PREFIX:
            t = parse_time(text)
        else:
            t = self._times.time_at(offset) if self._times is not None else None
        if self.since is not None and t is not None and t < self.since:
            return None
        return LogLine(t, text)

    def _flush(self) -> list[LogLine]:
        """The partial last line, as a line (the file ended or was replaced)."""
        if not self._partial:
            return []
        raw, self._partial = self._partial, b""
        offset = self._pos
        self._pos += len(raw)
        if self._clock == Clock.NONE:
            return [LogLine(None, _text(raw))]
        if self._times is not None:
            self._times.refresh()
        line = self._line(offset, raw)
        return [] if line is None else [line]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").rstrip("\r")


def history(follower: LogFollower, *, rotated: bool) -> Iterator[list[LogLine]]:
    """Batches of a log's history: its rotated files (oldest first) when ``rotated``, then what the
    current file holds now; ``follower`` is left where the current file ends, to follow or
    ``finish``. A rotated file last written before ``since`` is skipped unread."""
    sources: list[LogFollower] = []
    if rotated:
        for old in rotated_files(follower.path):
            try:
                if follower.since is not None and old.stat().st_mtime < follower.since:
                    continue
            except OSError:
                continue
            sources.append(follower.sibling(old))
    for source in [*sources, follower]:
        batch: list[LogLine] = []
        for line in source.drain():
            batch.append(line)
            if len(batch) >= _HISTORY_BATCH:
                yield batch
                batch = []
        if source is not follower:
            batch += source.finish()
        if batch:
            yield batch


def open_log(
    path: Path, *, tail_lines: int | None, since: float | None, timestamps: bool
) -> LogFollower:
    """A follower of ``path`` that reads times only when asked to, from where its kind keeps them
    (``agent.log`` lines start with their time; engine logs have an index)."""
    clock = Clock.NONE
    if since is not None or timestamps:
        clock = Clock.PREFIX if path.name == AGENT_LOG else Clock.INDEX
    return LogFollower(path, tail_lines=tail_lines, since=since, clock=clock)


# ---- /logs on the wire ----
# ``format=text`` (the default, for people and curl): one line per line, with ``timestamps=1``
# each starting with its time (``format_time``, or ``-`` when unknown) and a space.
# ``format=json`` (for tilert-submit): one ``WireLine`` per line, and when following one
# ``WireLine(live=True)`` where the history ends, so a reader can show sources one after another.


class WireLine(msgspec.Struct, omit_defaults=True):
    """One message of ``/logs?format=json``: a line and its time, or the end of the history."""

    line: str = ""
    time: float | None = None
    live: bool = False


LIVE = msgspec.json.encode(WireLine(live=True)) + b"\n"


def text_lines(lines: list[LogLine], timestamps: bool) -> bytes:
    """``lines`` as ``/logs?format=text`` sends them."""
    if not timestamps:
        return "".join(f"{line.text}\n" for line in lines).encode()
    return "".join(
        f"{format_time(line.time) if line.time is not None else '-'} {line.text}\n"
        for line in lines
    ).encode()


def json_lines(lines: list[LogLine]) -> bytes:
    """``lines`` as ``/logs?format=json`` sends them."""
    encode = msgspec.json.encode
    return b"".join(encode(WireLine(line.text, line.time)) + b"\n" for line in lines)


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
    follower = LogFollower(path, tail_lines=tail_lines)
    async for batch in follower.batches(poll_s=poll_s, stop=stop):
        for line in batch:
            yield line.text
