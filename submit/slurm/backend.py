"""Jobs on Slurm: submitted with sbatch, watched with squeue, stopped with scancel.

Stop: ``scancel --signal=TERM`` (every step's tasks, the agents, get SIGTERM; they stop their
engines within the grace, the steps end with 0 and the batch script ends normally), then a plain
``scancel`` if the job outlives the grace. Not ``--full``: checked on Slurm 22.05, it also signals
the ``srun`` clients in the batch shell, and an ``srun`` client that gets SIGTERM aborts its step
with SIGKILL, so the agents would never drain.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import msgspec

from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan
from agent.job.records import JobStatus
from submit.backend import Backend, BackendError, Submitted, wait_until
from submit.slurm import client

# Types only: `status` of any job asks this backend whether it owns the job; the pool file and
# the atomic writer (tempfile) are imported by `stop` and `scale` where they use them.
if TYPE_CHECKING:
    from agent.job.pool import DecodePool

# How long a job may take to leave squeue after a plain scancel (TERM, then KILL).
SCANCEL_WAIT_S = 10.0


def _job_id(status: JobStatus) -> str:
    if not status.slurm_job_id:
        raise ValueError("status.json names no Slurm job")
    return status.slurm_job_id


class SlurmBackend(Backend):
    """A job whose agents run as the steps of one Slurm job (``J/sbatch.sh``)."""

    ask_every_s = 5.0

    def owns(self, status: JobStatus) -> bool:
        """Whether status.json records a Slurm job id."""
        return bool(status.slurm_job_id)

    def submit(self, job: JobDir, _plan: Plan, secrets: Mapping[str, str]) -> Submitted:
        """sbatch ``J/sbatch.sh`` and record the job id in status.json (or the failure)."""
        # Secrets written in the recipe travel in sbatch's process environment (exported to the
        # agents), never in a file or argv; the recipe's value wins over the submitting shell's.
        env = {**os.environ, **secrets}
        try:
            job_id = client.sbatch(job.sbatch, env=env)
        except client.SlurmError as exc:
            status = job.read_status()
            job.write_status(
                msgspec.structs.replace(status, state="failed", error=f"not submitted: {exc}")
            )
            raise BackendError(str(exc)) from None
        status = job.read_status()
        job.write_status(
            msgspec.structs.replace(status, slurm_job_id=job_id, updated_at=time.time())
        )
        return Submitted(job=job, slurm_job_id=job_id)

    def is_running(self, status: JobStatus) -> bool | None:
        """Whether Slurm still runs or queues the job; None while Slurm cannot be asked."""
        return client.job_active(_job_id(status))

    def gone(self, status: JobStatus) -> str:
        """The Slurm job has ended."""
        return f"Slurm job {_job_id(status)} has ended but status.json still says {status.state}"

    def summary(self, status: JobStatus) -> str:
        """The Slurm job id."""
        return f"slurm job: {_job_id(status)}"

    def not_running(self, status: JobStatus) -> str:
        """The Slurm job is not running."""
        return f"Slurm job {_job_id(status)} is not running (status.json: {status.state})"

    def stop(
        self, job: JobDir, status: JobStatus, limit: float, say: Callable[[str], None] = print
    ) -> None:
        """TERM every task of the job (and of the jobs that grew its pool), wait for them to end,
        scancel them for good after ``limit``."""
        ids = [_job_id(status), *grow_job_ids(job)]
        for job_id in ids:
            try:
                if job_id == ids[0] or client.job_active(job_id):
                    stop_job(job_id, limit, say)
            except client.SlurmError as exc:
                raise BackendError(f"could not stop Slurm job {job_id}: {exc}") from None

    def grow(self, job: JobDir, status: JobStatus, pool: DecodePool, indexes: list[int]) -> None:
        """A second Slurm job for the same job folder: one decode agent per new index, with the
        first job's agent command; its id recorded in ``J/pool.json`` (``stop`` ends it too)."""
        # Imported here: the batch script's renderer pulls in the recipe layer (the cluster
        # file's YAML reader), which `status`, `stop` and `logs` of any job never need.
        from agent.job.atomicfile import write_atomic
        from agent.job.pool import GrowJob, write_pool
        from submit.slurm.render import agent_command_of, render_grow

        if not indexes:
            return
        first = _job_id(status)
        try:
            plan = load_plan(job.plan.read_bytes())
            command = agent_command_of(job.sbatch.read_text())
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            raise BackendError(f"cannot write the job that grows the pool: {exc}") from None
        script = render_grow(plan, job, command, indexes, first)
        path = job.root / f"sbatch-grow-{'-'.join(str(i) for i in indexes)}.sh"
        write_atomic(path, script.encode(), mode=0o755)
        try:
            job_id = client.sbatch(path, env=dict(os.environ))
        except client.SlurmError as exc:
            raise BackendError(f"sbatch {path} failed: {exc}") from None
        print(f"Submitted Slurm job {job_id} for {', '.join(f'decode-{i}' for i in indexes)}")
        pool.grow_jobs.append(GrowJob(slurm_job_id=job_id, indexes=list(indexes)))
        write_pool(job, pool)


def grow_job_ids(job: JobDir) -> list[str]:
    """The Slurm jobs that grew the pool of ``job`` (``J/pool.json``); none when unreadable."""
    from agent.job.pool import PoolFileError, read_pool  # `stop`'s (see the imports' comment)

    try:
        pool = read_pool(job, 0)
    except (OSError, PoolFileError):
        return []
    return [g.slurm_job_id for g in pool.grow_jobs]


def stop_job(job_id: str, limit: float, say: Callable[[str], None] = print) -> None:
    """``scancel --signal=TERM``, wait up to ``limit`` s, then a plain ``scancel``."""
    say(f"stopping Slurm job {job_id}: scancel --signal=TERM (agents drain, up to {limit:g}s)")
    client.scancel(job_id, signal_name="TERM")
    if wait_until(lambda: client.job_active(job_id) is False, limit):
        say(f"Slurm job {job_id} ended")
        return
    say(f"Slurm job {job_id} still running after {limit:g}s: scancel {job_id}")
    client.scancel(job_id)
    wait_until(lambda: client.job_active(job_id) is False, SCANCEL_WAIT_S)
