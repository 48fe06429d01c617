"""``tilert-submit logs``: prefixes, order, one source, bad input, --agent, and -f until SIGINT."""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.job.paths import JobDir
from submit import logview

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
    assert "is not a job directory" in err and "Traceback" not in err


def test_empty_job_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = JobDir(tmp_path / "J")
    job.create()
    assert run(job.root) == 0
    out = capsys.readouterr()
    assert out.out == "" and "no logs yet" in out.err


def test_colour_only_on_a_terminal() -> None:
    class Tty:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    plain, coloured = Tty(), Tty()
    logview._Printer(plain, ["a", "bb"], colour=False).emit("a", ["x"])  # type: ignore[arg-type]
    logview._Printer(coloured, ["a", "bb"], colour=True).emit("bb", ["x"])  # type: ignore[arg-type]
    assert plain.text == "a  | x\n"
    assert coloured.text.startswith("\033[") and coloured.text.endswith("bb |\033[0m x\n")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started by a test; their groups are killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


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
    if not script.exists():
        pytest.skip(f"{script} is not installed")
    done = subprocess.run(
        [str(script), "logs", str(job.root), "router"], capture_output=True, timeout=30
    )
    assert (done.returncode, done.stdout) == (0, b"router | r1\n")
    done = subprocess.run([str(script), "logs", str(job.root), "nope"], capture_output=True)
    assert done.returncode == 2 and b"prefill-0, decode-0, router" in done.stderr
