"""Engine log capture: rotated files and a ring of recent lines, never stalling the engine.

A stalled file system never blocks the engine. ``LogSink.pump`` reads the pipe on the trio loop
into a bounded in-memory queue; a separate writer task hands queued batches to a worker thread
(``trio.to_thread``), because the job directory lives on a shared file system where one
``write()`` can stall for seconds, and a stall on the loop would stop the reader (filling the
pipe and blocking the engine), the probes and ``/status`` all at once. When the queue is full the
reader waits for the writer to take its next batch (the engine then waits for its pipe, as it
would for a file of its own), but never more than ``_STALL_S``: a file that takes no batch for
that long costs lines instead (the newest are dropped, counted, and noted in the file once it
catches up) until it takes one again. The ring of recent lines still gets every line, so a
failure report shows what really happened.

Throughput (an engine writing 64 KiB at a time): the pipe is widened to 1 MiB and read 1 MiB at
a time; a read is queued as one block of whole lines, never split into lines on the loop's thread
unless a line is too long (holding the GIL there starved the writer thread, and lines were
dropped while the disk had room); the writer takes everything queued and writes it with one
``writev`` (each system call gives the GIL up, and taking it back can cost a switch interval).

The time each batch was read from the pipe goes into the log file's side index (``engine.times``,
``agent.job.logtimes``), so ``tilert-submit logs --timestamps`` and ``--since`` know when each
line arrived while the file keeps exactly the engine's bytes.
"""

import contextlib
import fcntl
import logging
import logging.handlers
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import trio

from agent.launch.spec import ProcessHandle
from agent.node.rotatedfile import RotatedFile

# Memory the queue may hold while the file is behind (beyond it, lines are dropped).
DEFAULT_QUEUE_BYTES = 8 * 1024 * 1024
_READ_CHUNK = 1024 * 1024
_BATCH_BYTES = 8 * 1024 * 1024
# How much of an unfinished line partial watchers see (its newest redraws).
_PARTIAL_TAIL = 4096
# How long the reader waits for the file to take a batch before it drops lines instead.
_STALL_S = 0.1
# How long a cancelled pump keeps trying to get its queue into the file (shutdown must stay short).
_DRAIN_ON_CANCEL_S = 1.0
# How long a one-shot process's last output may take to reach the file once it has exited (a
# grandchild may still hold the pipe open).
PUMP_DRAIN_S = 2.0
DROP_NOTICE = "[tilert-agent] dropped {lines} lines ({bytes} bytes) the log file could not take"

_log = logging.getLogger(__name__)


def _cut(data: bytes, limit: int) -> int:
    """Where to split ``data`` at most ``limit`` bytes in, backing off to a character start."""
    pos = limit
    # A continuation byte (0b10xxxxxx) never starts a character; a character is at most 4 bytes.
    while pos > limit - 3 and pos > 1 and data[pos] & 0xC0 == 0x80:
        pos -= 1
    return pos if data[pos] & 0xC0 != 0x80 else limit


def _widen_pipe(stream: trio.abc.ReceiveStream) -> None:
    """Let the engine's pipe hold ``_READ_CHUNK`` (64 KiB by default), where the kernel allows.

    Each read then takes up to 1 MiB: a 64 KiB pipe wakes the agent and stops the engine once
    per 64 KiB, which cost more than the reading itself.
    """
    fileno = getattr(stream, "fileno", None)
    if fileno is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fileno(), fcntl.F_SETPIPE_SZ, _READ_CHUNK)


def _fits(block: bytes, limit: int) -> bool:
    """Whether every line of ``block`` (whole lines) is at most ``limit`` bytes; no split."""
    start = 0
    while len(block) - start > limit + 1:
        newline = block.rfind(b"\n", start, start + limit + 1)
        if newline < 0:
            return False
        start = newline + 1
    return True


def _pieces(line: bytes, limit: int) -> Iterator[bytes]:
    """``line`` split into pieces of at most ``limit`` bytes."""
    while len(line) > limit:
        pos = _cut(line, limit)
        yield line[:pos]
        line = line[pos:]
    yield line


class LogSink:
    """Captures one engine's output into a size-rotated file, a ring of recent lines and counters.

    Lines longer than ``max_line_bytes`` are **split** into pieces of at most that many bytes (at a
    UTF-8 character boundary when there is one nearby), so no byte is lost and each piece is a line
    of its own. The file gets the raw bytes; ``recent()`` decodes with ``errors="replace"``.
    Rotation is by size: a line that would take ``path`` past ``max_bytes`` goes, whole, into a
    fresh file after ``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest is deleted); a
    single line larger than ``max_bytes`` gets a file of its own. Counters count the engine's bytes
    and lines (newline included), never ``note()`` text: once every ``pump`` has returned,
    ``lines_written + lines_dropped`` is every line the engine wrote. Use it from one trio thread.
    """

    # The file is written in a worker thread (a stalled file system must not stall the loop).
    # Tests on trio's autojump clock write on the loop instead (tests/kit/fakelauncher.py's
    # ``InlineSink``): while a thread works the loop looks idle, so that clock jumps to the next
    # deadline, and a wait for the thread that only a far deadline bounds jumps to that deadline.
    write_in_thread: ClassVar[bool] = True

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        backups: int,
        ring_lines: int = 500,
        max_line_bytes: int = 64 * 1024,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> None:
        if max_bytes < 1 or backups < 0 or max_line_bytes < 4 or ring_lines < 1:
            raise ValueError("max_bytes >= 1, backups >= 0, max_line_bytes >= 4, ring_lines >= 1")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.max_line_bytes = max_line_bytes
        self.queue_bytes = queue_bytes
        self.lines_written = 0
        self.bytes_written = 0
        self.lines_dropped = 0
        self.bytes_dropped = 0
        self.ring_lines = ring_lines
        # Blocks of whole lines (engine output and notes) with their line counts, newest last.
        self._ring: deque[tuple[bytes, int]] = deque()
        self._ring_count = 0
        # Items are (block of whole lines, engine lines in it, engine bytes in it, received at).
        self._queue: deque[tuple[bytes, int, int, float]] = deque()
        self._queued_bytes = 0
        self._unnoted_lines = 0
        self._unnoted_bytes = 0
        self._enqueued = 0
        self._written = 0
        self._pumps = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()  # the writer took a batch off the queue
        self._stalled = False  # the file took no batch for _STALL_S: drop, do not wait
        self._write_lock = trio.Lock()
        # The file itself, written in a worker thread (agent.node.rotatedfile).
        self.file = RotatedFile(path, max_bytes=max_bytes, backups=backups)
        self._failing = False
        # Called with every block of whole engine lines as it is read (REQSTAT figures, failure
        # signatures, startup progress): the lines pass by once, the file is never read again.
        self.watchers: list[Callable[[bytes], None]] = []
        # Called with the end of an unfinished line that a carriage return redrew (a progress bar).
        self.partial_watchers: list[Callable[[bytes], None]] = []

    # ---- reading side (trio loop) ----

    async def pump_until_exit(self, process: ProcessHandle) -> int:
        """Pump a one-shot ``process``'s output until it exits (and ``PUMP_DRAIN_S`` more for what
        is left in the pipe); its exit status."""
        async with trio.open_nursery() as nursery:
            pumped = trio.Event()

            async def pump() -> None:
                try:
                    await self.pump(process.output)
                finally:
                    pumped.set()

            nursery.start_soon(pump)
            code = await process.wait()
            with trio.move_on_after(PUMP_DRAIN_S):
                await pumped.wait()
            nursery.cancel_scope.cancel()
        return code

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        """Read ``stream`` to EOF into the ring and the file queue; never waits for the file."""
        self._pumps += 1
        _widen_pipe(stream)
        try:
            async with trio.open_nursery() as nursery:
                target: list[int] = []
                nursery.start_soon(self._write_until, target)
                await self._read(stream)
                self._note_drops()
                target.append(self._enqueued)
                self._lot.unpark_all()
        finally:
            # Cancelled (engine gone, agent stopping): give the queue a short, shielded last chance.
            with trio.move_on_after(_DRAIN_ON_CANCEL_S, shield=True):
                self._note_drops()
                while self._queue:
                    await self._write_batch()
            self._pumps -= 1

    async def _read(self, stream: trio.abc.ReceiveStream) -> None:
        """Cut the stream into blocks of whole lines; the partial last line at EOF is one too."""
        partial = b""
        while True:
            try:
                data = await stream.receive_some(_READ_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                if partial:
                    self._accept(partial + b"\n")
                return
            block, partial = self._whole_lines(partial, bytes(data))
            if block:
                await self._room_for(len(block))
                self._accept(block)
            if partial and self.partial_watchers and b"\r" in data:
                # A progress bar (tqdm) redraws its line with CR and ends it only when done.
                for watcher in self.partial_watchers:
                    watcher(partial[-_PARTIAL_TAIL:])

    async def _room_for(self, size: int) -> None:
        """Wait while the queue is full and the file is taking batches, at most ``_STALL_S``.

        The engine then waits for its pipe as it would for a file of its own, and no line is
        dropped while the disk keeps up; a file system that takes no batch for ``_STALL_S`` costs
        lines instead of engine time, until it takes one again.
        """
        if self._stalled:
            return
        with trio.move_on_after(_STALL_S) as waited:
            while self._queued_bytes and self.queue_bytes - self._queued_bytes < size:
                await self._room.park()
        self._stalled = waited.cancelled_caught

    def _whole_lines(self, partial: bytes, data: bytes) -> tuple[bytes, bytes]:
        """Complete lines (each at most ``max_line_bytes``) as one block, and the unfinished rest.

        No split into lines unless one is too long: this runs on the event loop's thread for
        every read, and holding the GIL there starves the thread that writes the file.
        """
        limit = self.max_line_bytes
        end = data.rfind(b"\n") + 1
        if not end:
            block, rest = b"", partial + data
        elif end == len(data) and not partial:
            block, rest = data, b""
        else:  # one copy, not two
            block, rest = b"".join((partial, memoryview(data)[:end])), data[end:]
        if not _fits(block, limit):
            lines = block.split(b"\n")[:-1]
            block = b"".join(piece + b"\n" for line in lines for piece in _pieces(line, limit))
        while len(rest) > limit:
            pos = _cut(rest, limit)
            block += rest[:pos] + b"\n"
            rest = rest[pos:]
        return block, rest

    def _accept(self, block: bytes) -> None:
        """Ring and queue for complete engine lines; what does not fit the queue is dropped."""
        lines = block.count(b"\n")
        self._remember(block, lines)
        self._watch(block)
        room = self.queue_bytes - self._queued_bytes
        if len(block) <= room or not self._queued_bytes:  # one read may exceed a small queue
            self._push(block, lines, len(block))
            return
        cut = block.rfind(b"\n", 0, room) + 1 if room > 0 else 0
        kept = block.count(b"\n", 0, cut)
        if cut:
            self._push(block[:cut], kept, cut)
        self.lines_dropped += lines - kept
        self.bytes_dropped += len(block) - cut
        self._unnoted_lines += lines - kept
        self._unnoted_bytes += len(block) - cut

    def _watch(self, block: bytes) -> None:
        """Hand ``block`` to every watcher; a watcher's bug costs its figures, never the log."""
        for watcher in list(self.watchers):
            try:
                watcher(block)
            except Exception:
                # Once: a watcher that fails on one block would fail on the next ones too.
                self.watchers.remove(watcher)
                _log.exception(
                    "log watcher %r failed on %s; it is switched off", watcher, self.path
                )

    def _remember(self, block: bytes, lines: int) -> None:
        """Keep the newest blocks holding the last ``ring_lines`` lines (``recent`` splits them)."""
        self._ring.append((block, lines))
        self._ring_count += lines
        while self._ring_count - self._ring[0][1] >= self.ring_lines:
            self._ring_count -= self._ring.popleft()[1]

    def _push(self, block: bytes, lines: int, nbytes: int) -> None:
        """Queue a block for the file, after the notice of any drop before it."""
        if self._unnoted_lines and lines:
            self._note_drops()
        # Called as the block is read (or noted): the time its lines were received.
        self._queue.append((block, lines, nbytes, time.time()))
        self._queued_bytes += len(block)
        self._enqueued += 1
        self._lot.unpark_all()

    def _note_drops(self) -> None:
        """Queue the notice of lines dropped since the last one (the queue has room for it now)."""
        if not self._unnoted_lines:
            return
        text = DROP_NOTICE.format(lines=self._unnoted_lines, bytes=self._unnoted_bytes)
        self._unnoted_lines = self._unnoted_bytes = 0
        self._remember(text.encode() + b"\n", 1)
        self._push(text.encode() + b"\n", 0, 0)

    def note(self, text: str) -> None:
        """Add a line of the agent's own (``=== engine started pid 123 ===``) to file and ring."""
        lines = [line.encode() for line in text.splitlines()] or [b""]
        self._remember(b"\n".join(lines) + b"\n", len(lines))
        self._push(b"\n".join(lines) + b"\n", 0, 0)
        if not self._pumps:
            # No writer task is running (between engine runs): a note is small, write it now.
            self._note_drops()
            items = list(self._queue)
            self._take(len(items))
            self._account(items, self._write_sync([(item[0], item[3]) for item in items]))

    def recent(self, n: int = 50) -> list[str]:
        """The last ``n`` lines (engine output and notes), decoded with ``errors="replace"``."""
        if n <= 0:
            return []
        lines = [line for block, _ in self._ring for line in block.split(b"\n")[:-1]]
        tail = lines[-min(n, self.ring_lines) :]
        return [line.decode("utf-8", "replace").rstrip("\r") for line in tail]

    # ---- writing side ----

    async def _write_until(self, target: list[int]) -> None:
        """Write batches until the pump's EOF target is in the file."""
        while not (target and self._written >= target[0]):
            if self._queue:
                await self._write_batch()
            else:
                self._note_drops()
                if not self._queue:
                    await self._lot.park()

    def _take(self, count: int) -> None:
        """Remove ``count`` items from the front of the queue."""
        for _ in range(count):
            block = self._queue.popleft()[0]
            self._queued_bytes -= len(block)
        self._room.unpark_all()

    async def _write_batch(self) -> None:
        """Write up to ``_BATCH_BYTES`` of the queue in a worker thread, one batch at a time."""
        async with self._write_lock:
            items: list[tuple[bytes, int, int, float]] = []
            size = 0
            for item in self._queue:
                if items and size + len(item[0]) > _BATCH_BYTES:
                    break
                items.append(item)
                size += len(item[0])
            if not items:
                return
            # Taken off the queue before the write, so the reader has room while the thread works.
            self._take(len(items))
            try:
                blocks = [(item[0], item[3]) for item in items]
                if self.write_in_thread:
                    error = await trio.to_thread.run_sync(self._write_sync, blocks)
                else:
                    await trio.lowlevel.checkpoint()
                    error = self._write_sync(blocks)
            except BaseException:
                # Cancelled before the thread started: nothing was written, keep it queued.
                self._queue.extendleft(reversed(items))
                self._queued_bytes += size
                raise
            self._account(items, error)

    def _account(self, items: list[tuple[bytes, int, int, float]], error: OSError | None) -> None:
        """Counters after a write: written, or dropped when the file system refused it."""
        lines = sum(item[1] for item in items)
        nbytes = sum(item[2] for item in items)
        self._written += len(items)
        self._stalled = False
        if error is None:
            self.lines_written += lines
            self.bytes_written += nbytes
            if self._failing:
                self._failing = False
                _log.info("writing %s works again", self.path)
            return
        self.lines_dropped += lines
        self.bytes_dropped += nbytes
        self._unnoted_lines += lines
        self._unnoted_bytes += nbytes
        if not self._failing:
            self._failing = True
            _log.warning("cannot write %s (%s); dropping engine output", self.path, error)

    def _write_sync(self, blocks: list[tuple[bytes, float]]) -> OSError | None:
        """Append (block, received at) to the file, rotating between lines (a worker thread);
        the error that refused them, if any."""
        return self.file.write(blocks)

    def close(self) -> None:
        """Close the file (a later write reopens it)."""
        self.file.close()
