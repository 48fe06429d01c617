"""The job backends behind ``status`` and ``stop``: which one a job has, is it running, stop it.

Local: a real child process stands for the ``--local`` supervisor. Slurm: stand-in ``squeue`` and
``scancel`` on PATH (the real Slurm runs in the e2e Slurm tests).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import psutil
import pytest

from agent.job.paths import JobDir
from agent.job.plan import AGENT_EXIT_SLACK_S, load_plan
from agent.job.records import JobStatus
from submit.choice import backend_for, backend_of
from submit.cli import main
from submit.local.backend import LocalBackend, pid_alive
from submit.slurm.backend import SlurmBackend
from tests.golden import GOLDEN_DIR, RECIPES

DEMO = RECIPES / "local-demo.yaml"

STUB_SQUEUE = """#!/bin/sh
# Stand-in squeue -h -j ID -o %T: the state in $FAKE_SLURM/state; FORGOTTEN as Slurm says it.
state=$(cat "$FAKE_SLURM/state")
if [ "$state" = FORGOTTEN ]; then
    echo "slurm_load_jobs error: Invalid job id specified" >&2
    exit 1
fi
echo "$state"
"""
STUB_SCANCEL = """#!/bin/sh
# Stand-in scancel: logs its argv; TERM moves the job to $FAKE_SLURM/on_term, a plain one ends it.
echo "$*" >> "$FAKE_SLURM/scancel.log"
if [ -e "$FAKE_SLURM/fail" ]; then
    echo "scancel: error: Kill job error on job id $2: Access/permission denied" >&2
    exit 1
fi
case "$1" in
    --signal=TERM) cat "$FAKE_SLURM/on_term" > "$FAKE_SLURM/state" ;;
    *) echo CANCELLED > "$FAKE_SLURM/state" ;;
esac
"""


def status_of(**fields: object) -> JobStatus:
    """A live-looking status.json with ``fields`` set."""
    return msgspec.structs.replace(
        JobStatus(state="ready", model="m", agents=[]), updated_at=time.time(), **fields
    )


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobDir:
    """A dry-run job directory of the demo recipe."""
    monkeypatch.delenv("TILERT_CLUSTER_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    return JobDir(root)


def record(job: JobDir, **fields: object) -> None:
    """Make ``status.json`` say the job is ready and runs where ``fields`` say."""
    status = job.read_status()
    job.write_status(
        msgspec.structs.replace(status, state="ready", updated_at=time.time(), **fields)
    )


# ---- which backend ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"slurm_job_id": "42"}, SlurmBackend),
        ({"local_pid": 4242}, LocalBackend),
        ({"slurm_job_id": "42", "local_pid": 4242}, SlurmBackend),
        ({}, None),
        ({"slurm_job_id": "", "local_pid": 0}, None),
    ],
)
def test_backend_of_reads_status_json(fields: dict[str, object], expected: type | None) -> None:
    backend = backend_of(status_of(**fields))
    if expected is None:
        assert backend is None
    else:
        assert isinstance(backend, expected)


def test_backend_for_a_new_job() -> None:
    assert isinstance(backend_for(local=True), LocalBackend)
    assert isinstance(backend_for(local=False), SlurmBackend)


def test_drain_s_is_router_then_the_slower_worker() -> None:
    plan = load_plan((GOLDEN_DIR / "b200-nixl-glm5.plan.json").read_bytes())
    assert plan.drain_s() == 5.0 + 20.0 + AGENT_EXIT_SLACK_S
    slow_decode = msgspec.structs.replace(plan.decode, stop_grace_s=60.0)
    plan = msgspec.structs.replace(plan, decode=slow_decode)
    assert plan.drain_s() == 5.0 + 60.0 + AGENT_EXIT_SLACK_S


# ---- local ------------------------------------------------------------------------------------


Child = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def child() -> Iterator[Child]:
    """Starts supervisor stand-ins: children that sleep; SIGTERM ends them unless ignore_term.
    ``args`` end their command line (a supervisor's names its job directory)."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, ignore_term: bool = False) -> subprocess.Popen[str]:
        code = (
            "import signal, sys, time\n"
            f"if {ignore_term}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        with proc.stdout:  # it says nothing after "up"
            assert proc.stdout.readline() == "up\n"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def supervised_by(proc: subprocess.Popen[str], **fields: object) -> dict[str, object]:
    """status.json fields naming ``proc`` as the local supervisor (its pid and start time)."""
    return {
        "local_pid": proc.pid,
        "local_started_at": psutil.Process(proc.pid).create_time(),
        **fields,
    }


def test_local_is_running_follows_the_process(child: Child) -> None:
    proc = child()
    status = status_of(local_pid=proc.pid)
    backend = LocalBackend()
    assert backend.is_running(status) is True
    proc.kill()
    # Exited but not reaped yet (a zombie): not running.
    deadline = time.monotonic() + 5
    while backend.is_running(status) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.is_running(status) is False
    proc.wait()
    assert backend.is_running(status) is False
    assert not pid_alive(proc.pid)


def test_local_stop_terms_the_supervisor(
    job: JobDir,
    child: Child,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc = child(str(job.root))
    record(job, **supervised_by(proc))
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 0
    out = capsys.readouterr().out
    assert f"SIGTERM to its supervisor pid {proc.pid}" in out
    assert "stopped" in out
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_local_stop_kills_after_the_limit(
    job: JobDir, child: Child, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = child(str(job.root), ignore_term=True)
    LocalBackend().stop(job, status_of(**supervised_by(proc)), limit=0.5)
    assert f"pid {proc.pid} did not exit within 0.5s; sending SIGKILL" in capsys.readouterr().out
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_local_stop_while_stopping_sends_no_second_signal(
    job: JobDir, child: Child, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second SIGTERM would force the supervisor's stop: a second `stop` only waits for it.
    proc = child(str(job.root))
    status = status_of(**supervised_by(proc, state="stopping"))
    LocalBackend().stop(job, status, limit=0.5)
    assert "already stopping" in capsys.readouterr().out
    assert proc.wait(timeout=5) == -signal.SIGKILL  # no SIGTERM came before the limit


@pytest.fixture
def stranger() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts unrelated processes (``sleep``), killed after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*argv: str) -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen(list(argv or ("sleep", "600"))))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("its own start time", "does not name"),
        ("an older start time", "the pid now names another process"),
        ("no start time", "does not name"),
        ("names the job, older start time", "the pid now names another process"),
    ],
)
def test_local_stop_refuses_a_pid_that_is_not_the_supervisor(
    job: JobDir,
    stranger: Callable[..., subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
    case: str,
    says: str,
) -> None:
    """A stale job directory whose status.json names a live unrelated process (pid reuse): a
    refusal naming the pid and why, exit 1, and no signal: the process lives on."""
    if case.startswith("names the job"):
        proc = stranger("sh", "-c", "sleep 600", str(job.root))
    else:
        proc = stranger()
    started = psutil.Process(proc.pid).create_time()
    at = {
        "its own start time": started,
        "an older start time": started - 3600,
        "no start time": None,
        "names the job, older start time": started - 3600,
    }[case]
    record(job, local_pid=proc.pid, local_started_at=at)
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 1
    err = capsys.readouterr().err
    assert f"not signalling pid {proc.pid}" in err, err
    assert says in err, err
    time.sleep(0.3)
    assert proc.poll() is None, "the stranger was signalled"


def test_local_stop_and_status_when_the_supervisor_is_gone(
    job: JobDir,
    child: Child,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc = child()
    proc.kill()
    proc.wait()
    record(job, local_pid=proc.pid)
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 0
    assert capsys.readouterr().out == (
        "nothing to stop: the job is ready and no supervisor is running\n"
    )
    assert main(["status", str(job.root)]) == 0
    out = capsys.readouterr().out
    assert f"STALE: the local supervisor (pid {proc.pid}) is gone" in out
    assert f"local supervisor pid: {proc.pid}" in out


def test_stop_without_a_backend(job: JobDir, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 0
    assert capsys.readouterr().out == (
        "nothing to stop: the job is pending and no supervisor is running\n"
    )


# ---- Slurm ------------------------------------------------------------------------------------


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-in squeue and scancel on PATH; the job's state in the returned folder's ``state``."""
    bin_dir, state = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("squeue", STUB_SQUEUE), ("scancel", STUB_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (state / "state").write_text("RUNNING\n")
    (state / "on_term").write_text("COMPLETED\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_SLURM", str(state))
    return state


@pytest.mark.parametrize(
    ("state", "running"),
    [("RUNNING", True), ("PENDING", True), ("COMPLETED", False), ("FORGOTTEN", False)],
)
def test_slurm_is_running_asks_squeue(fake_slurm: Path, state: str, running: bool) -> None:
    (fake_slurm / "state").write_text(state + "\n")
    assert SlurmBackend().is_running(status_of(slurm_job_id="42")) is running


def test_slurm_is_running_unknown_without_squeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert SlurmBackend().is_running(status_of(slurm_job_id="42")) is None


def test_slurm_stop_terms_every_task(
    job: JobDir, fake_slurm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record(job, slurm_job_id="42")
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 0
    out = capsys.readouterr().out
    assert "stopping Slurm job 42: scancel --signal=TERM" in out
    assert "Slurm job 42 ended" in out
    assert (fake_slurm / "scancel.log").read_text() == "--signal=TERM 42\n"


def test_slurm_stop_cancels_after_the_limit(
    job: JobDir, fake_slurm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (fake_slurm / "on_term").write_text("RUNNING\n")
    SlurmBackend().stop(job, status_of(slurm_job_id="42"), limit=0.3)
    assert "Slurm job 42 still running after 0.3s: scancel 42" in capsys.readouterr().out
    assert (fake_slurm / "scancel.log").read_text() == "--signal=TERM 42\n42\n"


def test_slurm_stop_and_status_once_the_job_ended(
    job: JobDir, fake_slurm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (fake_slurm / "state").write_text("COMPLETED\n")
    record(job, slurm_job_id="42")
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 0
    assert capsys.readouterr().out == "Slurm job 42 is not running (status.json: ready)\n"
    assert not (fake_slurm / "scancel.log").exists()
    assert main(["status", str(job.root), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["stale"] is True
    assert view["stale_reason"] == "Slurm job 42 has ended but status.json still says ready"
    assert main(["status", str(job.root)]) == 0
    assert "\nslurm job: 42\n" in capsys.readouterr().out


def test_slurm_stop_failure_exits_1(
    job: JobDir, fake_slurm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (fake_slurm / "fail").touch()
    record(job, slurm_job_id="42")
    capsys.readouterr()
    assert main(["stop", str(job.root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tilert-submit: could not stop Slurm job 42: scancel --signal=TERM 42")
    assert "Access/permission denied" in err
