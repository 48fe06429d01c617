"""agent.logs: engine log capture (never blocks, splits, rotates), agent.log, follow_file,
log_files."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from agent.job.logfiles import log_files, log_path, rotated_files
from agent.job.logtail import LogLine, follow_file, history, open_log
from agent.job.logtimes import format_time, times_path
from agent.job.paths import JobDir
from agent.node import logpump
from agent.node.agentlog import setup_agent_logging
from agent.node.logpump import DROP_NOTICE, LogSink
from tests import kit

PY = sys.executable


@contextlib.asynccontextmanager
async def child(code: str) -> AsyncIterator[trio.Process]:
    """A Python child whose stdout is a pipe; its whole group is killed on the way out."""
    proc = await trio.lowlevel.open_process(
        [PY, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True):
            await proc.wait()


async def pump_bytes(sink: LogSink, data: bytes) -> None:
    """Pump what a real child process writes (``data``, then EOF) into ``sink``."""
    code = f"import sys; sys.stdout.buffer.write({data!r}); sys.stdout.flush()"
    async with child(code) as proc:
        assert proc.stdout is not None
        with trio.fail_after(20):
            await sink.pump(proc.stdout)
            assert await proc.wait() == 0


def all_files(path: Path) -> list[Path]:
    """Rotated files oldest first, then the current one."""
    return [*rotated_files(path), path]


class SlowSink(LogSink):
    """A sink whose file system takes ``delay`` seconds per batch (a stalled NFS server)."""

    delay = 0.5

    def _write_sync(self, blocks: list[tuple[bytes, float]]) -> OSError | None:
        time.sleep(self.delay)
        return super()._write_sync(blocks)


async def test_slow_file_never_blocks_the_engine(tmp_path: Path) -> None:
    line_len, count = 1000, 52_429  # 50 MiB as fast as the child can write it
    code = (
        "import sys\n"
        f"lines = [b'%08d ' % i + b'x' * {line_len - 10} + b'\\n' for i in range({count})]\n"
        "for i in range(0, len(lines), 1000):\n"
        "    sys.stdout.buffer.write(b''.join(lines[i:i + 1000]))\n"
        "sys.stdout.flush()\n"
    )
    path = tmp_path / "engine.log"
    sink = SlowSink(path, max_bytes=1 << 40, backups=1, queue_bytes=2 << 20)
    async with child(code) as proc:
        assert proc.stdout is not None
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sink.pump, proc.stdout)
                assert await proc.wait() == 0
                # The child is done while the (2 MiB/s) file holds a fraction of its 50 MiB.
                in_file_when_child_done = path.stat().st_size if path.exists() else 0
                assert sink.lines_dropped > 0
    assert in_file_when_child_done < 25 * 1024 * 1024
    assert sink.lines_written + sink.lines_dropped == count
    assert sink.bytes_written + sink.bytes_dropped == count * line_len
    data = path.read_bytes()
    notice_start = DROP_NOTICE.split("{")[0].encode()
    notices = [ln for ln in data.split(b"\n") if ln.startswith(notice_start)]
    assert notices
    noted = sum(int(m[1]) for n in notices if (m := re.search(rb"dropped (\d+) lines", n)))
    assert noted == sink.lines_dropped
    engine_lines = [ln for ln in data.split(b"\n")[:-1] if not ln.startswith(b"[tilert-agent]")]
    assert len(engine_lines) == sink.lines_written
    numbers = [int(ln[:8]) for ln in engine_lines]
    assert all(len(ln) == line_len - 1 for ln in engine_lines)  # whole lines only
    assert numbers == sorted(numbers)  # in order, lost lines are gaps
    # The ring saw the very last line (followed by the drop notice).
    assert sink.recent(2)[0].startswith(f"{count - 1:08d} ")
    assert sink.recent(2)[1].startswith("[tilert-agent] dropped")


# An engine writing 64 KiB at a time as fast as it can (numbered lines of varied length).
FAST_64K = (
    "import os, sys\n"
    "n = int(sys.argv[1])\n"
    "data = b''.join(b'%08d ' % i + b'x' * (i % 300) + b'\\n' for i in range(n))\n"
    "for i in range(0, len(data), 65536):\n"
    "    view = memoryview(data)[i : i + 65536]\n"
    "    while view:\n"
    "        view = view[os.write(1, view) :]\n"
)


async def pump_64k(sink: LogSink, count: int) -> None:
    """Pump FAST_64K's ``count`` lines into ``sink`` (to EOF)."""
    proc = await trio.lowlevel.open_process(
        [PY, "-c", FAST_64K, str(count)], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        with trio.fail_after(60):
            await sink.pump(proc.stdout)
            assert await proc.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True):
            await proc.wait()


def check_numbered(path: Path, count: int) -> None:
    """The file holds FAST_64K's ``count`` lines, whole and in order."""
    lines = path.read_bytes().split(b"\n")
    assert lines.pop() == b""
    assert len(lines) == count
    assert all(ln == b"%08d " % i + b"x" * (i % 300) for i, ln in enumerate(lines))


async def test_64k_writes_lose_nothing_while_the_file_keeps_up(tmp_path: Path) -> None:
    """An engine that outpaces the file waits for its pipe, as it would for a file of its own:
    no line is dropped while the file takes batches (the queue here holds only 256 KiB)."""
    count = 120_000  # ~18 MiB
    path = tmp_path / "engine.log"
    sink = LogSink(path, max_bytes=1 << 40, backups=1, queue_bytes=256 * 1024)
    await pump_64k(sink, count)
    assert (sink.lines_dropped, sink.lines_written) == (0, count)
    check_numbered(path, count)
    assert sink.recent(2) == [f"{i:08d} " + "x" * (i % 300) for i in (count - 2, count - 1)]


async def test_a_slow_file_that_keeps_taking_batches_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow (50 ms a batch) is not stalled: the engine is slowed down, nothing is dropped."""
    monkeypatch.setattr(logpump, "_STALL_S", 5.0)  # a loaded test machine must not look stalled
    count = 30_000
    path = tmp_path / "engine.log"
    sink = SlowSink(path, max_bytes=1 << 40, backups=1, queue_bytes=512 * 1024)
    sink.delay = 0.05
    await pump_64k(sink, count)
    assert sink.lines_dropped == 0
    check_numbered(path, count)


async def test_unwritable_file_counts_drops_and_keeps_reading(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("")
    sink = LogSink(tmp_path / "not-a-dir" / "engine.log", max_bytes=1000, backups=1)
    await pump_bytes(sink, b"".join(b"line %d\n" % i for i in range(2000)))
    assert sink.lines_written == 0
    assert sink.lines_dropped == 2000
    assert sink.recent(2)[0] == "line 1999"


async def test_long_lines_are_split_at_character_boundaries(tmp_path: Path) -> None:
    long = ("é" * 130).encode()  # 260 bytes of 2-byte characters
    sink = LogSink(tmp_path / "engine.log", max_bytes=1 << 20, backups=1, max_line_bytes=101)
    await pump_bytes(sink, b"short\n" + long + b"\nend\n" + b"z" * 250)
    lines = (tmp_path / "engine.log").read_bytes().split(b"\n")
    assert lines[-1] == b""
    lines = lines[:-1]
    assert all(len(ln) <= 101 for ln in lines)
    assert lines[0] == b"short"
    i = lines.index(b"end")
    assert b"".join(lines[1:i]) == long
    assert all(ln.decode() for ln in lines[1:i])  # each piece is valid UTF-8 on its own
    assert b"".join(lines[i + 1 :]) == b"z" * 250  # an unterminated long tail too
    assert sink.lines_written == len(lines)


async def test_partial_last_line_and_invalid_utf8(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "engine.log", max_bytes=1 << 20, backups=1)
    await pump_bytes(sink, b"a\r\nbad \xff\xfe byte\nlast-no-newline")
    assert (tmp_path / "engine.log").read_bytes() == b"a\r\nbad \xff\xfe byte\nlast-no-newline\n"
    assert sink.recent() == ["a", "bad \ufffd\ufffd byte", "last-no-newline"]
    assert (sink.lines_written, sink.bytes_written) == (3, 31)


async def test_rotation_keeps_every_line_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    lines = [b"%04d " % i + b"y" * (i % 97) for i in range(600)]
    lines.insert(300, b"H" * 1500)  # larger than a whole file
    sink = LogSink(path, max_bytes=1000, backups=1000)
    await pump_bytes(sink, b"".join(ln + b"\n" for ln in lines))
    files = all_files(path)
    assert len(files) > 30
    contents = [f.read_bytes() for f in files]
    assert all(c.endswith(b"\n") for c in contents)  # no line is cut across two files
    assert all(len(c) <= 1000 for c in contents if b"H" * 1500 not in c)
    assert b"".join(contents).split(b"\n")[:-1] == lines


async def test_rotation_deletes_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    lines = [b"line %05d" % i for i in range(1000)]
    sink = LogSink(path, max_bytes=500, backups=2)
    await pump_bytes(sink, b"".join(ln + b"\n" for ln in lines))
    assert [p.name for p in all_files(path)] == ["engine.log.2", "engine.log.1", "engine.log"]
    kept = b"".join(f.read_bytes() for f in all_files(path)).split(b"\n")[:-1]
    assert kept == lines[-len(kept) :]


async def test_recent_ring_and_notes(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "decode-0" / "engine.log"
    sink = LogSink(path, max_bytes=1 << 20, backups=1, ring_lines=10)
    sink.note("=== engine started pid 123 (generation 1) ===")  # no pump running: written now
    assert path.read_text() == "=== engine started pid 123 (generation 1) ===\n"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    await pump_bytes(sink, b"".join(b"out %d\n" % i for i in range(100)))
    sink.note("=== engine exited with code 1 ===")
    assert sink.recent(3) == ["out 98", "out 99", "=== engine exited with code 1 ==="]
    assert len(sink.recent(50)) == 10
    assert sink.recent(0) == []
    text = path.read_text().splitlines()
    assert text[0].startswith("=== engine started")
    assert text[-1].startswith("=== engine exited")
    assert sink.lines_written == 100  # notes are not engine output


async def test_note_while_pumping_keeps_order(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    sink = LogSink(path, max_bytes=1 << 20, backups=1)
    # The child prints 'after' only once the note is written (the go file), not after a fixed
    # sleep that a loaded machine can outlast before the note.
    go = tmp_path / "go"
    code = (
        "import os, time\n"
        "print('before', flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print('after')\n"
    )
    async with child(code) as proc:
        assert proc.stdout is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sink.pump, proc.stdout)
            await kit.until(lambda: sink.recent(1) == ["before"], "the line 'before' in the ring")
            sink.note("--- note ---")
            go.touch()
    assert path.read_text() == "before\n--- note ---\nafter\n"


async def test_cancelled_pump_still_writes_what_it_read(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    sink = LogSink(path, max_bytes=1 << 20, backups=1)
    # The child keeps its stdout open: only cancellation ends the pump (a surviving grandchild).
    code = "import sys, time\nprint('x' * 100, flush=True)\ntime.sleep(60)\n"
    async with child(code) as proc:
        assert proc.stdout is not None
        with trio.move_on_after(10) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sink.pump, proc.stdout)
                await kit.until(lambda: bool(sink.recent(1)), "the first line in the ring")
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
    assert path.read_text() == "x" * 100 + "\n"


def test_agent_log_format_and_rotation(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "logs" / "decode-0" / "agent.log"
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        setup_agent_logging(path, name="decode-0", max_bytes=2000, backups=2)
        log = setup_agent_logging(path, name="decode-0", max_bytes=2000, backups=2)  # idempotent
        log.info("hello %s", "world")
        logging.getLogger("agent.supervisor").error("engine failed; last lines:\nl1\nl2")
        logging.getLogger("httpx").info("HTTP Request: GET /health")  # silenced
        stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
        lines = path.read_text().splitlines()
        assert re.fullmatch(stamp + " decode-0 INFO hello world", lines[0])
        assert len(lines) == 4
        assert all(re.match(stamp + " decode-0 ERROR ", ln) for ln in lines[1:])
        assert lines[3].endswith(" l2")
        err = capfd.readouterr().err
        assert err.count("decode-0 INFO hello world") == 1
        for i in range(100):
            log.info("filler %03d %s", i, "f" * 50)
        assert [p.name for p in rotated_files(path)] == ["agent.log.2", "agent.log.1"]
    finally:
        for h in [h for h in root.handlers if h not in before[0]]:
            root.removeHandler(h)
            h.close()
        root.setLevel(before[1])


async def test_follow_file_waits_for_the_file_and_survives_rotation(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    expected = [f"line {i:03d} " + "w" * 40 for i in range(200)]
    seen: list[str] = []
    stop = trio.Event()

    async def collect() -> None:
        async for line in follow_file(path, poll_s=0.02, stop=stop):
            seen.append(line)

    # The writer is another process: it creates the file late and rotates it many times.
    writer = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from agent.node.logpump import LogSink\n"
        "time.sleep(0.3)\n"
        f"sink = LogSink(Path({str(path)!r}), max_bytes=1000, backups=3)\n"
        f"for i, line in enumerate({expected!r}):\n"
        "    sink.note(line)\n"
        "    if i % 10 == 0: time.sleep(0.05)\n"
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        with trio.fail_after(20):
            await trio.run_process([PY, "-c", writer])
            await kit.until(lambda: len(seen) >= len(expected), "every line followed", 20)
        stop.set()
    assert seen == expected
    assert len(rotated_files(path)) == 3


async def test_follow_file_tail_then_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("".join(f"old {i}\n" for i in range(10)) + "partial")
    stop = trio.Event()
    seen: list[str] = []

    async def collect() -> None:
        async for line in follow_file(path, tail_lines=3, poll_s=0.02, stop=stop):
            seen.append(line)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        with trio.fail_after(10):
            await kit.until(lambda: seen == ["old 8", "old 9"], "the last two complete lines")
            with path.open("a") as f:
                f.write(" line\nnew\nunfinished")
            await kit.until(lambda: len(seen) >= 4, "the two new lines")
        stop.set()
    assert seen == ["old 8", "old 9", "partial line", "new", "unfinished"]


def test_log_files_map(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "J")
    job.create()
    assert log_files(job) == {}
    for name in ("decode-10", "decode-2", "prefill-0", "stray", "decode-x"):
        job.log_dir(name).mkdir()
    assert list(log_files(job)) == ["prefill-0", "decode-2", "decode-10", "router"]
    assert log_files(job)["router"] == job.logs / "prefill-0" / "router.log"
    assert log_files(job)["decode-2"] == job.logs / "decode-2" / "engine.log"
    assert list(log_files(job, agent=True)) == ["prefill-0", "decode-2", "decode-10"]
    assert log_path(job, "decode-2", agent=True) == job.logs / "decode-2" / "agent.log"
    with pytest.raises(ValueError, match=r"no agent\.log of its own"):
        log_path(job, "router", agent=True)


# ---- receive times (engine.times) and reading by time -------------------------------------------


def read_all(path: Path, **options: object) -> list[LogLine]:
    """Every line of ``path``'s history (rotated files first) with the given reading options."""
    follower = open_log(path, **options)  # type: ignore[arg-type]
    lines = [line for batch in history(follower, rotated=True) for line in batch]
    return lines + follower.finish()


def test_times_paths() -> None:
    assert times_path(Path("d/engine.log")) == Path("d/engine.times")
    assert times_path(Path("d/engine.log.12")) == Path("d/engine.times.12")
    assert times_path(Path("d/router.log")) == Path("d/router.times")


async def test_receive_times_follow_their_files_through_rotation(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    sink = LogSink(path, max_bytes=100, backups=50)
    t0 = time.time()
    await pump_bytes(sink, b"".join(b"first %03d\n" % i for i in range(40)))
    await trio.sleep(0.2)
    middle = time.time()
    await trio.sleep(0.05)
    await pump_bytes(sink, b"".join(b"second %03d\n" % i for i in range(40)))
    t1 = time.time()
    # Every log file has its index, naming that very file.
    files = all_files(path)
    assert len(files) > 5
    for f in files:
        index = times_path(f).read_bytes()
        assert index[:8] == b"TLTIMES1"
        assert int.from_bytes(index[8:16], "little") == f.stat().st_ino
    # The file itself is exactly the engine's bytes.
    assert b"".join(f.read_bytes() for f in files).count(b"\n") == 80
    timed = read_all(path, tail_lines=None, since=None, timestamps=True)
    assert [line.text for line in timed][:2] == ["first 000", "first 001"]
    assert all(line.time is not None and t0 <= line.time <= t1 for line in timed)
    first = [line.time for line in timed if line.text.startswith("first")]
    second = [line.time for line in timed if line.text.startswith("second")]
    assert max(first) < middle < min(second)  # type: ignore[type-var, operator]
    # --since: the later lines only, the older rotated files skipped.
    since = read_all(path, tail_lines=None, since=middle, timestamps=False)
    assert [line.text for line in since] == [f"second {i:03d}" for i in range(40)]
    assert read_all(path, tail_lines=None, since=t1 + 60, timestamps=False) == []
    # --tail and --since together: the last N, none older than since.
    follower = open_log(path, tail_lines=3, since=t0 - 60, timestamps=False)
    assert [line.text for line in follower.finish()][-3:] == [
        "second 037",
        "second 038",
        "second 039",
    ]


def test_files_without_an_index_have_no_times(tmp_path: Path) -> None:
    """A file from before the index (or anybody's file): times unknown, --since keeps it all."""
    path = tmp_path / "engine.log"
    path.write_text("a\nb\n")
    lines = read_all(path, tail_lines=None, since=time.time() - 5, timestamps=True)
    assert lines == [LogLine(None, "a"), LogLine(None, "b")]


def test_agent_log_times_come_from_the_lines(tmp_path: Path) -> None:
    path = tmp_path / "agent.log"
    path.write_text(
        "2026-12-02T11:22:33.123Z decode-0 INFO old\n"
        "2026-12-02T11:30:00.000Z decode-0 INFO new\n"
        "no time here\n"
    )
    lines = read_all(path, tail_lines=None, since=None, timestamps=True)
    assert lines[0].time == pytest.approx(1796210553.123)
    assert format_time(lines[1].time or 0) == "2026-12-02T11:30:00.000Z"
    assert lines[2] == LogLine(None, "no time here")
    since = read_all(path, tail_lines=None, since=lines[1].time, timestamps=False)
    assert [line.text.split()[-1] for line in since] == ["new", "here"]
