"""``tilert-submit stop J``: stop a Slurm or local job so that agents drain and nothing is left.

Slurm: ``scancel --signal=TERM`` (every step's tasks, the agents, get SIGTERM; they stop their
engines within the grace, the steps end with 0 and the batch script ends normally), then a plain
``scancel`` if the job outlives the grace. Not ``--full``, which DESIGN.md first named: checked on
Slurm 22.05, it also signals the ``srun`` clients in the batch shell, and an ``srun`` client that
gets SIGTERM aborts its step with SIGKILL, so the agents would never drain. Local: SIGTERM to the ``--local`` supervisor, which stops its agents.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

from agent.job.plan import load_plan
from agent.job.records import JobStatus
from submit.slurm import client as slurm
from submit.statusview import open_job, pid_alive

POLL_S = 0.2
SLACK_S = 10.0


def grace_s(plan_bytes: bytes) -> float:
    """How long a drain may take: router, then the slower worker, plus slack."""
    plan = load_plan(plan_bytes)
    return (
        plan.router.stop_grace_s
        + max(plan.prefill.stop_grace_s, plan.decode.stop_grace_s)
        + SLACK_S
    )


def _wait(predicate: Callable[[], bool], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()


def stop_slurm(job_id: str, limit: float) -> int:
    """TERM every task of the job, wait for it to end, scancel it for good after ``limit``."""
    print(f"stopping Slurm job {job_id}: scancel --signal=TERM (agents drain, up to {limit:g}s)")
    slurm.scancel(job_id, signal_name="TERM")
    if _wait(lambda: slurm.job_active(job_id) is False, limit):
        print(f"Slurm job {job_id} ended")
        return 0
    print(f"Slurm job {job_id} still running after {limit:g}s: scancel {job_id}")
    slurm.scancel(job_id)
    _wait(lambda: slurm.job_active(job_id) is False, SLACK_S)
    return 0


def stop_local(pid: int, limit: float) -> int:
    """SIGTERM the local supervisor and wait for it to exit."""
    print(f"stopping the local job: SIGTERM to its supervisor pid {pid} (up to {limit:g}s)")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print("it had already exited")
        return 0
    if _wait(lambda: not pid_alive(pid), limit):
        print("stopped")
        return 0
    print(f"pid {pid} did not exit within {limit:g}s; sending SIGKILL (its agents die with it)")
    os.kill(pid, signal.SIGKILL)
    return 0


def main(args: argparse.Namespace) -> int:
    """Stop the job; 0 also when it had already stopped."""
    job = open_job(args.job_dir)
    status: JobStatus = job.read_status()
    limit = grace_s(job.plan.read_bytes())
    if status.slurm_job_id:
        try:
            if slurm.job_active(status.slurm_job_id) is False:
                print(
                    f"Slurm job {status.slurm_job_id} is not running (status.json: {status.state})"
                )
                return 0
            return stop_slurm(status.slurm_job_id, limit)
        except slurm.SlurmError as exc:
            print(
                f"tilert-submit: could not stop Slurm job {status.slurm_job_id}: {exc}",
                file=sys.stderr,
            )
            return 1
    if status.local_pid and pid_alive(status.local_pid):
        return stop_local(status.local_pid, limit)
    print(f"nothing to stop: the job is {status.state} and no supervisor is running")
    return 0
