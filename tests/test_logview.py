"""``tilert-submit logs`` on job directories the tests write: prefixes, order, names and patterns,
--since, --timestamps, colours, bad input, --agent, and -f until SIGINT, the job's end or a closed
pipe. The same on real jobs: tests/test_logs_cli.py."""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

from agent.job.logtail import LogLine
from agent.job.paths import JobDir
from agent.job.records import JobAgent, JobStatus
from agent.job.vocab import AgentState, JobState, as_role
from submit import logview
from submit.logview.catalogue import Catalogue, Selection, Source
from submit.logview.command import parse_since
from submit.logview.follow import Session
from submit.logview.options import Options
from submit.logview.printer import Printer, wants_colour
from tests.conftest import require

PY = sys.executable


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    """A job directory with engine logs for prefill-0, decode-0 (rotated once), and the router."""
    job = JobDir(tmp_path / "J")
    job.create()
    for name in ("prefill-0", "decode-0"):
        job.log_dir(name).mkdir(mode=0o700)
    logs = job.logs
    (logs / "prefill-0" / "engine.log").write_text("p1\np2\n")
    (logs / "prefill-0" / "router.log").write_text("r1\n")
    (logs / "prefill-0" / "agent.log").write_text("prefill agent says hi\n")
    (logs / "decode-0" / "engine.log.1").write_bytes(b"d1\nd2 \xff\n")
    (logs / "decode-0" / "engine.log").write_text("d3\nd4-partial")
    return job


def run(job_dir: Path | str, *extra: str) -> int:
    """Parse like the CLI would, then call main()."""
    parser = argparse.ArgumentParser()
    logview.add_arguments(parser)
    return logview.main(parser.parse_args([str(job_dir), *extra]))


def test_all_sources_with_prefixes_in_file_order(
    job: JobDir, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(job.root) == 0
    assert capsys.readouterr().out.splitlines() == [
        "prefill-0 | p1",
        "prefill-0 | p2",
        "decode-0  | d1",
        "decode-0  | d2 \ufffd",
        "decode-0  | d3",
        "decode-0  | d4-partial",
        "router    | r1",
    ]


def test_main_with_a_bare_namespace(job: JobDir, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(job_dir=str(job.root), name="router", follow=False)
    assert logview.main(args) == 0
    assert capsys.readouterr().out == "router | r1\n"


def test_tail_and_agent_log(job: JobDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(job.root, "decode-0", "--tail", "1") == 0
    assert capsys.readouterr().out == "decode-0 | d4-partial\n"
    assert run(job.root, "--agent") == 0
    assert capsys.readouterr().out == "prefill-0 | prefill agent says hi\n"


def test_unknown_name_lists_the_known_ones(job: JobDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(job.root, "decode-7") == 2
    err = capsys.readouterr().err
    assert "unknown NAME 'decode-7'" in err
    assert "prefill-0, decode-0, router" in err
    assert run(job.root, "router", "--agent") == 2
    assert "router has no agent.log" in capsys.readouterr().err


def test_not_a_job_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path / "missing") == 2
    assert "does not exist" in capsys.readouterr().err
    assert run(tmp_path) == 2
    err = capsys.readouterr().err
    assert "is not a job directory" in err
    assert "Traceback" not in err


def test_empty_job_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = JobDir(tmp_path / "J")
    job.create()
    assert run(job.root) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert "no logs yet" in out.err


class Captured:
    """A stdout stand-in: what was written, and whether it says it is a terminal."""

    def __init__(self, tty: bool = False) -> None:
        self.text = ""
        self.tty = tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


def test_colour_prefix_and_timestamps() -> None:
    plain, coloured, stamped = Captured(), Captured(), Captured()
    Printer(plain, ["a", "bb"], colour=False).emit("a", [LogLine(None, "x")])  # type: ignore[arg-type]
    Printer(coloured, ["a", "bb"], colour=True).emit("bb", [LogLine(None, "x")])  # type: ignore[arg-type]
    printer = Printer(stamped, ["a"], colour=False, timestamps=True)  # type: ignore[arg-type]
    printer.emit("a", [LogLine(1796230000.5, "x"), LogLine(None, "y")])
    assert plain.text == "a  | x\n"
    assert coloured.text.startswith("\033[")
    assert coloured.text.endswith("bb |\033[0m x\n")
    assert stamped.text == "a | 2026-12-02T16:46:40.500Z x\na | -                        y\n"


def test_colour_only_on_a_terminal_without_no_color() -> None:
    tty, pipe = Captured(tty=True), Captured()
    assert wants_colour(tty, no_color=False, env={})  # type: ignore[arg-type]
    assert not wants_colour(pipe, no_color=False, env={})  # type: ignore[arg-type]
    assert not wants_colour(tty, no_color=True, env={})  # type: ignore[arg-type]
    assert not wants_colour(tty, no_color=False, env={"NO_COLOR": "1"})  # type: ignore[arg-type]
    # no-color.org: only a non-empty NO_COLOR counts.
    assert wants_colour(tty, no_color=False, env={"NO_COLOR": ""})  # type: ignore[arg-type]


def test_since_durations_and_iso_times() -> None:
    now = 1_800_000_000.0
    assert parse_since("10m", now) == now - 600
    assert parse_since("1h30m", now) == now - 5400
    assert parse_since("1.5h", now) == now - 5400
    assert parse_since("2d", now) == now - 2 * 86400
    assert parse_since("500ms", now) == now - 0.5
    utc = datetime(2026, 12, 2, 11, 22, 33, tzinfo=UTC).timestamp()
    assert parse_since("2026-12-02T11:22:33Z", now) == utc
    assert parse_since("2026-12-02T12:22:33+01:00", now) == utc
    naive = datetime(2026, 12, 2, 11, 22, 33).astimezone().timestamp()  # local time
    assert parse_since("2026-12-02T11:22:33", now) == naive
    assert parse_since("2026-12-02 11:22:33", now) == naive
    for bad in ("10", "m", "10x", "yesterday", "", "-5m"):
        with pytest.raises(ValueError, match="neither a duration"):
            parse_since(bad, now)


def test_names_patterns_and_benchmark(job: JobDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(job.root, "decode-*", "router") == 0
    assert capsys.readouterr().out.splitlines() == [
        "decode-0 | d1",
        "decode-0 | d2 \ufffd",
        "decode-0 | d3",
        "decode-0 | d4-partial",
        "router   | r1",
    ]
    # Shown in the job's order whatever the order asked in; a source named twice once.
    assert run(job.root, "router", "prefill-0", "p*", "--tail", "1") == 0
    assert capsys.readouterr().out.splitlines() == ["prefill-0 | p2", "router    | r1"]
    assert run(job.root, "x*") == 2
    assert (
        "no source matches 'x*'; this job has: prefill-0, decode-0, router"
        in capsys.readouterr().err
    )
    assert run(job.root, "benchmark") == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert "benchmark: no log yet" in out.err
    assert "logs/benchmark/benchmark.log" in out.err
    bench = job.log_dir("benchmark")
    bench.mkdir()
    (bench / "benchmark.log").write_text("b1\n")
    assert run(job.root) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "benchmark | b1"
    assert run(job.root, "benchmark", "--agent") == 2
    assert "benchmark has no agent.log" in capsys.readouterr().err


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started by a test; their groups are killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        for pipe in (p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


class LineReader:
    """Reads a child's stdout line by line with a deadline (no thread, no blocking forever)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.lines: list[str] = []

    def until(self, line: str, timeout: float = 15) -> None:
        """Read until ``line`` has been printed."""
        deadline = time.monotonic() + timeout
        while line not in self.lines:
            left = deadline - time.monotonic()
            assert left > 0, f"{line!r} not printed; got {self.lines}"
            if select.select([self.fd], [], [], left)[0]:
                data = os.read(self.fd, 65536)
                assert data, f"stdout closed before {line!r}; got {self.lines}"
                self.buf += data
                *done, self.buf = self.buf.split(b"\n")
                self.lines += [d.decode() for d in done]


def test_follow_appended_and_late_sources_then_sigint(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    viewer = subprocess.Popen(
        [PY, "-m", "submit.logview", str(job.root), "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    procs.append(viewer)
    out = LineReader(viewer)
    out.until("router    | r1")
    assert out.lines[:3] == ["prefill-0 | p1", "prefill-0 | p2", "decode-0  | d1"]
    # Another process appends to prefill-0's engine log and finishes decode-0's partial line.
    appender = (
        "import sys, time\n"
        f"with open({str(job.logs / 'prefill-0' / 'engine.log')!r}, 'a') as f:\n"
        "    for i in range(5):\n"
        "        f.write(f'live {i}\\n'); f.flush(); time.sleep(0.05)\n"
        f"with open({str(job.logs / 'decode-0' / 'engine.log')!r}, 'a') as f:\n"
        "    f.write(' done\\n')\n"
    )
    procs.append(subprocess.Popen([PY, "-c", appender], start_new_session=True))
    out.until("prefill-0 | live 4")
    out.until("decode-0  | d4-partial done")
    # An agent that starts after the viewer: its folder, then its log, appear later.
    late = job.log_dir("decode-1")
    late.mkdir()
    (late / "engine.log").write_text("late hello\n")
    out.until("decode-1  | late hello")
    viewer.send_signal(signal.SIGINT)
    assert viewer.wait(timeout=10) == 0
    assert viewer.stderr is not None
    err = viewer.stderr.read().decode()
    assert "Traceback" not in err
    live = [ln for ln in out.lines if "live" in ln]
    assert live == [f"prefill-0 | live {i}" for i in range(5)]  # each line once, in order


def test_console_script(job: JobDir) -> None:
    script = Path(sys.executable).parent / "tilert-submit"
    require(script.exists(), f"{script} is not installed (pip install -e '.[test]')")
    done = subprocess.run(
        [str(script), "logs", str(job.root), "router"], capture_output=True, timeout=30
    )
    assert (done.returncode, done.stdout) == (0, b"router | r1\n")
    done = subprocess.run([str(script), "logs", str(job.root), "nope"], capture_output=True)
    assert done.returncode == 2
    assert b"prefill-0, decode-0, router" in done.stderr


# ---- -f ends with the job ----------------------------------------------------------------------


def write_status(job: JobDir, state: JobState, pid: int | None, **agents: AgentState) -> None:
    """status.json as the head writes it: the job's state, its supervisor, agents' states."""
    entries = [
        JobAgent(
            name=name.replace("_", "-"),
            role=as_role(name.split("_")[0]),
            index=int(name.split("_")[1]),
            node="n1",
            state=agent_state,
            restarts=0,
            reason="",
            log="",
            metrics_url=None,
            status_url=None,
        )
        for name, agent_state in agents.items()
    ]
    job.write_status(JobStatus(state=state, model="m", local_pid=pid, agents=entries))


def viewer(
    job: JobDir, procs: list[subprocess.Popen[bytes]], *args: str
) -> subprocess.Popen[bytes]:
    """``python -m submit.logview J -f ARGS`` with pipes, in its own group."""
    proc = subprocess.Popen(
        [PY, "-m", "submit.logview", str(job.root), "-f", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    procs.append(proc)
    return proc


def supervisor(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A process standing in for the job's local supervisor (``status.json``'s local_pid)."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    procs.append(proc)
    return proc


def test_follow_ends_0_once_stopped_and_the_supervisor_is_gone(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    sup = supervisor(procs)
    write_status(job, "ready", sup.pid)
    proc = viewer(job, procs)
    out = LineReader(proc)
    out.until("router    | r1")
    write_status(job, "stopped", sup.pid)
    assert proc.stderr is not None
    said = proc.stderr.readline().decode()  # it has seen "stopped": it waits for the supervisor
    assert said.startswith("tilert-submit logs: the job stopped; printing its last lines")
    assert proc.poll() is None
    with (job.logs / "prefill-0" / "engine.log").open("a") as f:
        f.write("last words\n")  # written while the job drains: printed before the end
    sup.kill()
    assert proc.wait(10) == 0
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert b"prefill-0 | last words\n" in proc.stdout.read()
    assert proc.stderr.read() == b""  # nothing more


def test_follow_ends_1_when_the_job_fails_or_its_supervisor_dies(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    sup = supervisor(procs)
    write_status(job, "ready", sup.pid)
    proc = viewer(job, procs)
    LineReader(proc).until("router    | r1")  # following now
    assert proc.poll() is None
    sup.kill()  # gone without status.json saying so: the job has failed
    assert proc.wait(10) == 1
    assert proc.stderr is not None
    assert b"(pid %d) is gone" % sup.pid in proc.stderr.read()
    write_status(job, "failed", None)
    assert viewer(job, procs).wait(10) == 1


def test_follow_of_names_ends_when_they_end(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    sup = supervisor(procs)
    write_status(job, "degraded", sup.pid, prefill_0="healthy", decode_0="failed")
    # decode-0 failed while the job goes on: its follower ends with 1, the others follow on.
    failed = viewer(job, procs, "decode-0")
    both = viewer(job, procs, "decode-*", "prefill-0")
    assert failed.wait(10) == 1
    assert failed.stdout is not None
    assert b"decode-0 | d4-partial\n" in failed.stdout.read()
    assert both.poll() is None
    write_status(job, "degraded", sup.pid, prefill_0="stopped", decode_0="failed")
    assert both.wait(10) == 1
    write_status(job, "stopping", sup.pid, prefill_0="stopped", decode_0="stopped")
    assert viewer(job, procs, "prefill-0", "decode-0").wait(10) == 0


def test_history_comes_before_an_end_decided_first(job: JobDir) -> None:
    """The end watcher decides before any reader starts (forced: the first scan for sources waits
    for its decision): the failed agent's history is printed all the same, then -f ends with 1."""
    write_status(job, "degraded", None, prefill_0="healthy", decode_0="failed")
    decided = threading.Event()
    selection = Selection(["decode-0"], Catalogue(job, None, agent=False))
    scan = selection.sources

    def sources_after_the_end() -> list[Source]:
        assert decided.wait(30), "the end watcher never decided"
        return scan()

    class EndFirst(Session):
        async def _watch_end(self) -> None:
            await super()._watch_end()
            assert self.stop.is_set()
            decided.set()

    selection.sources = sources_after_the_end  # type: ignore[method-assign]
    out = Captured()
    printer = Printer(out, ["decode-0"], colour=False)  # type: ignore[arg-type]
    session = EndFirst(job, selection, Options(follow=True), printer, token="")
    assert trio.run(session.run) == 1
    assert decided.is_set()
    assert out.text.splitlines() == [
        "decode-0 | d1",
        "decode-0 | d2 \ufffd",
        "decode-0 | d3",
        "decode-0 | d4-partial",
    ]


def test_follow_into_a_closed_pipe_ends_quietly(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    """``logs J -f | head -1`` ends with 0 even when no new line comes to find the pipe closed."""
    reader, writer = os.pipe()
    proc = subprocess.Popen(
        [PY, "-m", "submit.logview", str(job.root), "router", "-f"],
        stdout=writer,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    procs.append(proc)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        assert pipe.readline() == b"router | r1\n"
    # The reader is gone and the log never grows: the follower notices by itself.
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    assert proc.stderr.read() == b""


def test_follow_waits_for_a_named_log_and_says_so(
    job: JobDir, procs: list[subprocess.Popen[bytes]]
) -> None:
    proc = viewer(job, procs, "benchmark")
    assert proc.stderr is not None
    said = proc.stderr.readline().decode()  # before the benchmark has a folder
    assert "benchmark: no log yet" in said
    assert "waiting for it" in said
    bench = job.log_dir("benchmark")
    bench.mkdir()
    (bench / "benchmark.log").write_text("bench line\n")
    out = LineReader(proc)
    out.until("benchmark | bench line")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    assert proc.stderr.read() == b""


def test_follow_of_a_job_never_submitted_says_so_and_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --dry-run job (pending, no backend, no agent started): nothing will ever write to it."""
    job = JobDir(tmp_path / "J")
    job.create()
    write_status(job, "pending", None, prefill_0="pending")
    assert run(job.root, "-f") == 2
    err = capsys.readouterr().err
    assert "was never submitted" in err
    assert "Traceback" not in err
    # Once an agent has started (a systemd unit, say), -f follows it.
    job.log_dir("prefill-0").mkdir()
    (job.logs / "prefill-0" / "engine.log").write_text("started by hand\n")
    write_status(job, "stopped", None, prefill_0="stopped")
    assert run(job.root, "-f") == 0
    assert capsys.readouterr().out == "prefill-0 | started by hand\n"
