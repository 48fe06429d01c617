"""Where a job's agents run, behind one interface: Slurm (``submit.slurm``) or this machine
(``submit.local``).

A backend starts a job (``submit`` returns a ``Submitted`` handle or raises ``BackendError``; what a
person reads about it is the CLI's, ``submit.cli``), tells whether it still runs and stops it so
that its agents drain.
``status`` and ``stop`` ask the backend that ``status.json`` names (``backend_of``) and never
branch on "Slurm job id or local pid" themselves. A backend is imported when it is picked, and
the local one loads its supervisor (and trio) only to run a job: ``status``, ``stop`` and
``--help`` stay quick.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.errors import RuntimeFailure

# Types only: the interface costs a job command nothing beyond what its backend imports.
if TYPE_CHECKING:
    from agent.job.paths import JobDir
    from agent.job.plan import Plan
    from agent.job.pool import DecodePool
    from agent.job.records import JobStatus

POLL_S = 0.2


class BackendError(RuntimeFailure):
    """The backend could not do what was asked (Slurm unreachable, ...); ``str()`` says why."""


@dataclass(frozen=True)
class Submitted:
    """What ``Backend.submit`` started: the job directory and the id the backend knows it by
    (the fields of status.json that name it)."""

    job: JobDir
    slurm_job_id: str | None = None
    local_pid: int | None = None


class Backend(ABC):
    """How jobs of one kind are started, watched and stopped."""

    @abstractmethod
    def owns(self, status: JobStatus) -> bool:
        """Whether ``status.json`` names a job this backend started."""

    def claim(self, status: JobStatus) -> None:
        """Note in the first ``status.json`` what this backend knows before the job starts."""
        del status  # Slurm learns its job id only from sbatch: nothing to note before.

    @abstractmethod
    def submit(self, job: JobDir, plan: Plan, secrets: Mapping[str, str]) -> Submitted:
        """Start the written job and say what was started; BackendError when it could not."""

    @abstractmethod
    def is_running(self, status: JobStatus) -> bool | None:
        """Whether the job still runs (or waits to); None when that cannot be told now."""

    # How often a watcher may ask ``is_running`` (asking Slurm is a query to its controller).
    ask_every_s: float = 0.0

    @abstractmethod
    def gone(self, status: JobStatus) -> str:
        """Why a live ``status.json`` is not believed once ``is_running`` said False."""

    @abstractmethod
    def summary(self, status: JobStatus) -> str:
        """The line ``status`` shows for where the job runs."""

    @abstractmethod
    def stop(
        self, job: JobDir, status: JobStatus, limit: float, say: Callable[[str], None] = print
    ) -> None:
        """Stop the running job ``job`` so that its agents drain within ``limit`` s, saying each
        step of the wait through ``say`` (the user's terminal; the service front's log for a
        cell); BackendError when it could not (or must not)."""

    def grow(self, job: JobDir, status: JobStatus, pool: DecodePool, indexes: list[int]) -> None:
        """Start the decode agents ``indexes`` that ``pool`` (already in ``J/pool.json``) adds;
        BackendError when they cannot be. By default nothing: the job's own supervisor follows
        ``J/pool.json`` (``--local``)."""
        del job, status, pool, indexes

    def not_running(self, status: JobStatus) -> str:
        """What ``stop`` says when the job is not running."""
        return nothing_to_stop(status)


def nothing_to_stop(status: JobStatus) -> str:
    """What ``stop`` says when no supervisor of the job is running."""
    return f"nothing to stop: the job is {status.state} and no supervisor is running"


def wait_until(predicate: Callable[[], bool], limit: float) -> bool:
    """Poll ``predicate`` until it holds or ``limit`` s passed; whether it held."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()
