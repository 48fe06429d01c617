"""Running the project as users do, for the benchmarks: commands timed, local jobs started."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from agent.job.paths import JobDir
from agent.job.records import JobAgent, JobStatus
from tests.kit.commands import SUBMIT
from tests.kit.jobs import LocalJob, isolated_sets

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
READY_TIMEOUT_S = 120.0
SCALE_TIMEOUT_S = 600.0


def env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on the path and no inherited TILERT_* switch."""
    # Python keeps the bytecode it compiles (the warm-up runs write it, as a user's first run
    # does): a PYTHONDONTWRITEBYTECODE inherited from a test or CI shell would make every run
    # compile the project again and time the compiler (docs/performance.md, "CLI imports").
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TILERT_") and k != "PYTHONDONTWRITEBYTECODE"
    }
    out["PYTHONPATH"] = str(REPO)
    out.update(extra)
    return out


def scale(job: Path, count: int) -> None:
    """``tilert-submit scale J --decode COUNT`` as a user runs it (it must exit 0)."""
    done = subprocess.run(
        [*SUBMIT, "scale", str(job), "--decode", str(count)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=SCALE_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scale --decode {count} failed:\n{done.stdout}\n{done.stderr}")


def timed(argv: Sequence[str], *, cwd: Path = REPO) -> float:
    """Seconds ``argv`` takes from fork to exit (it must exit 0)."""
    start = time.perf_counter()
    done = subprocess.run(list(argv), cwd=cwd, env=env(), capture_output=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return took


def submit(*args: str) -> list[str]:
    """``tilert-submit ARGS`` as this interpreter runs it."""
    return [PY, "-m", "submit.cli", *args]


def read_status(job: Path) -> JobStatus | None:
    """status.json, or None while it is missing or half-written."""
    try:
        return JobDir(job).read_status()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def wait_status(
    job: Path, states: Sequence[str], timeout_s: float, poll_s: float = 0.005
) -> JobStatus:
    """status.json once its state is one of ``states`` (``failed`` raises)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(job)
        if status is not None and status.state in states:
            return status
        if status is not None and status.state == "failed":
            raise RuntimeError(f"{job}: job failed: {status.error}")
        time.sleep(poll_s)
    raise RuntimeError(f"{job}: not {states} within {timeout_s:g}s (see {job}/logs)")


@contextlib.contextmanager
def local_job(root: Path, *sets: str) -> Iterator[tuple[LocalJob, float]]:
    """The local demo (``--local --mock``, stand-in router, ports of its own) just started:
    (the job, ``time.monotonic()`` at tilert-submit's start). Every process of the job is gone
    on the way out."""
    args, _ = isolated_sets(None, *sets)
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with LocalJob(root / "job", args, env=env()) as job:
        yield job, start
        job.stop(30)


@contextlib.contextmanager
def ready_job(root: Path, *sets: str) -> Iterator[tuple[LocalJob, JobStatus, float]]:
    """The local demo once ready: (job, status, seconds from tilert-submit's start to ready)."""
    with local_job(root, *sets) as (job, start):
        status = wait_status(job.job, ("ready",), READY_TIMEOUT_S)
        yield job, status, time.monotonic() - start


def agent_row(status: JobStatus, name: str) -> JobAgent:
    """status.json's row of agent ``name``."""
    return next(a for a in status.agents if a.name == name)
