"""Engine log capture: rotated files and a ring of recent lines, never blocking the engine.

The engine is never blocked by its log pipe. ``LogSink.pump`` reads the pipe on the trio loop and
only ever appends to a bounded in-memory queue; a separate writer task hands queued batches to a
worker thread (``trio.to_thread``), because the job directory lives on a shared file system where
one ``write()`` can stall for seconds, and a stall on the loop would stop the reader (filling the
pipe and blocking the engine), the probes and ``/status`` all at once. A thread hop costs tens of
microseconds per batch of up to 1 MiB, so every batch goes through it, small ones included. When
the queue is full the newest lines are dropped (counted, and noted in the file once it catches up);
the ring of recent lines still gets every line, so a failure report shows what really happened.
The time each batch was read from the pipe goes into the log file's side index (``engine.times``,
``agent.job.logtimes``), so ``tilert-submit logs --timestamps`` and ``--since`` know when each
line arrived while the file keeps exactly the engine's bytes.
"""

import errno
import logging
import logging.handlers
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import trio

from agent.job.logtimes import TimesWriter, times_path
from agent.job.paths import PRIVATE_DIR_MODE

# Memory the queue may hold while the file is behind (beyond it, lines are dropped).
DEFAULT_QUEUE_BYTES = 8 * 1024 * 1024
_READ_CHUNK = 64 * 1024
_BATCH_BYTES = 1024 * 1024
# How long a cancelled pump keeps trying to get its queue into the file (shutdown must stay short).
_DRAIN_ON_CANCEL_S = 1.0
DROP_NOTICE = "[tilert-agent] dropped {lines} lines ({bytes} bytes) the log file could not take"

_log = logging.getLogger(__name__)


def _cut(data: bytes, limit: int) -> int:
    """Where to split ``data`` at most ``limit`` bytes in, backing off to a character start."""
    pos = limit
    # A continuation byte (0b10xxxxxx) never starts a character; a character is at most 4 bytes.
    while pos > limit - 3 and pos > 1 and data[pos] & 0xC0 == 0x80:
        pos -= 1
    return pos if data[pos] & 0xC0 != 0x80 else limit


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
        self._ring: deque[bytes] = deque(maxlen=ring_lines)
        # Items are (block of whole lines, engine lines in it, engine bytes in it, received at).
        self._queue: deque[tuple[bytes, int, int, float]] = deque()
        self._queued_bytes = 0
        self._unnoted_lines = 0
        self._unnoted_bytes = 0
        self._enqueued = 0
        self._written = 0
        self._pumps = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._write_lock = trio.Lock()
        self._file_lock = threading.Lock()
        self._fd: int | None = None
        self._times = TimesWriter()
        self._size = 0
        self._failing = False

    # ---- reading side (trio loop) ----

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        """Read ``stream`` to EOF into the ring and the file queue; never waits for the file."""
        self._pumps += 1
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
        """Split the stream into lines; the partial last line at EOF is kept as a line."""
        partial = b""
        while True:
            try:
                data = await stream.receive_some(_READ_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                if partial:
                    self._accept([partial])
                return
            lines, partial = self._split(partial, bytes(data))
            if lines:
                self._accept(lines)

    def _split(self, partial: bytes, data: bytes) -> tuple[list[bytes], bytes]:
        """Complete lines (each at most ``max_line_bytes``) and the unfinished rest."""
        buf = partial + data if partial else data
        limit = self.max_line_bytes
        lines: list[bytes] = []
        if b"\n" in data:
            lines = buf.split(b"\n")
            buf = lines.pop()
            if max(map(len, lines)) > limit:
                lines = [piece for line in lines for piece in _pieces(line, limit)]
        while len(buf) > limit:
            pos = _cut(buf, limit)
            lines.append(buf[:pos])
            buf = buf[pos:]
        return lines, buf

    def _accept(self, lines: list[bytes]) -> None:
        """Ring and queue for complete engine lines; what does not fit the queue is dropped."""
        self._ring.extend(lines)
        block = b"\n".join(lines) + b"\n"
        room = self.queue_bytes - self._queued_bytes
        if len(block) <= room:
            self._push(block, len(lines), len(block))
            return
        cut = block.rfind(b"\n", 0, room) + 1 if room > 0 else 0
        kept = block[:cut].count(b"\n")
        if cut:
            self._push(block[:cut], kept, cut)
        self.lines_dropped += len(lines) - kept
        self.bytes_dropped += len(block) - cut
        self._unnoted_lines += len(lines) - kept
        self._unnoted_bytes += len(block) - cut

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
        self._ring.append(text.encode())
        self._push(text.encode() + b"\n", 0, 0)

    def note(self, text: str) -> None:
        """Add a line of the agent's own (``=== engine started pid 123 ===``) to file and ring."""
        lines = [line.encode() for line in text.splitlines()] or [b""]
        self._ring.extend(lines)
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
        tail = list(self._ring)[-n:]
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
                error = await trio.to_thread.run_sync(self._write_sync, blocks)
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
        """Append (block, received at) to the file, rotating between lines (a worker thread)."""
        with self._file_lock:
            try:
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
                self._write_all(block)
                return
            cut = block.rfind(b"\n", 0, room) + 1 if room > 0 else 0
            if cut == 0 and self._size == 0:
                cut = block.find(b"\n") + 1 or len(block)
            if cut:
                self._write_all(block[:cut])
                block = block[cut:]
            if block:
                self._rotate()

    def _write_all(self, data: bytes) -> None:
        """``os.write`` until every byte is written."""
        fd = self._fd
        if fd is None:  # _write_block opens the file first; a closed sink writes nothing
            raise OSError(errno.EBADF, "the log file is closed", str(self.path))
        view = memoryview(data)
        while view:
            done = os.write(fd, view)
            view = view[done:]
        self._size += len(data)

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
