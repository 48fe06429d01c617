"""The Slurm client commands tilert-submit runs: sbatch, scancel, squeue, each bounded in time.

While slurmctld is down every client call can hang for seconds to minutes, and on a machine
without Slurm the commands do not exist: both become a ``SlurmError`` that says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import RuntimeFailure

# Imported where a client command runs: `status` of a local job imports this module (through
# the Slurm backend, asked whether it owns the job) and never runs one.
if TYPE_CHECKING:
    import subprocess

CLIENT_TIMEOUT_S = 30.0


class SlurmError(RuntimeFailure):
    """A Slurm client command is missing, timed out or failed; ``str()`` says what to do."""


def run_client(
    argv: Sequence[str],
    *,
    timeout: float = CLIENT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one Slurm client command; SlurmError unless it exits 0 within ``timeout``.

    Its output is read as UTF-8 whatever the locale, a byte that is not UTF-8 (a site's Latin-1
    partition name, feature or comment) read as U+FFFD: the one place every Slurm command's output
    is decoded, so none of them can end ``init`` or a submission with a traceback."""
    import shutil  # deferred: see the imports' comment
    import subprocess

    program = argv[0]
    if shutil.which(program, path=(env or os.environ).get("PATH")) is None:
        raise SlurmError(
            f"{program} is not on PATH: this machine has no Slurm client. Submit from a login "
            "node, or use --local to run here (--dry-run only writes the job directory)"
        )
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{program} did not answer within {timeout:g} s: is slurmctld up? (try `sinfo`)"
        ) from None
    except OSError as exc:
        raise SlurmError(f"cannot run {program}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip() or "no output"
        raise SlurmError(f"{' '.join(argv)} failed (exit {done.returncode}): {detail}")
    return done


def sbatch(script: Path, *, env: Mapping[str, str] | None = None) -> str:
    """Submit ``script``; the Slurm job id.

    ``--export=ALL`` on the command line (which beats a site's ``SBATCH_EXPORT``): secret values
    reach the agents through this process environment, never through a file or argv.
    """
    done = run_client(["sbatch", "--parsable", "--export=ALL", str(script)], env=env)
    # --parsable prints "id" or "id;cluster".
    job_id = done.stdout.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id (output: {done.stdout.strip()!r})")
    return job_id


def scancel(
    job_id: str,
    *,
    signal_name: str | None = None,
    full: bool = False,
    timeout: float = CLIENT_TIMEOUT_S,
) -> None:
    """``scancel [--signal=SIG] [--full] JOB``: without a signal, the job ends (TERM, then KILL)."""
    flags = [f"--signal={signal_name}"] if signal_name else []
    if full:
        # --full also reaches the batch shell, not only the steps' tasks.
        flags.append("--full")
    run_client(["scancel", *flags, job_id], timeout=timeout)


# squeue keeps an ended job for MinJobAge in one of these states.
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
    }
)
# `status` must answer quickly even while slurmctld is down.
QUERY_TIMEOUT_S = 10.0


def job_state(job_id: str, *, timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """The job's squeue state (``PENDING``, ``RUNNING``, ...), or None once Slurm forgot it."""
    try:
        done = run_client(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout=timeout)
    except SlurmError as exc:
        # squeue fails with "Invalid job id specified" once the job has left its memory.
        if "Invalid job id" in str(exc):
            return None
        raise
    state = done.stdout.strip().split("\n", 1)[0].strip()
    return state or None


def job_active(job_id: str, *, timeout: float = QUERY_TIMEOUT_S) -> bool | None:
    """Whether Slurm still runs (or queues) the job; None when Slurm cannot be asked."""
    try:
        state = job_state(job_id, timeout=timeout)
    except SlurmError:
        return None
    return state is not None and state not in ENDED_STATES
