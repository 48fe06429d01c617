"""How the keeper starts, watches and stops cells, whatever runs them (``CellLauncher``).

The launchers themselves are ``submit.servecells``'s (Slurm: sbatch, squeue, scancel; local: a
detached ``tilert-submit --local`` per cell): this layer must not import the submit backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from agent.job.paths import JobDir
from agent.service.records import CellRecord


@dataclass(frozen=True)
class CellIds:
    """How the backend knows a submitted cell (``CellRecord``'s fields of the same names)."""

    slurm_job_id: str | None = None
    local_pid: int | None = None
    local_started_at: float | None = None


@dataclass(frozen=True)
class CellFacts:
    """What the backend says of one cell now."""

    # Whether its job still runs or waits to; None when that cannot be told now (Slurm down).
    running: bool | None
    # Seconds until the job's end (Slurm's ``%L``; local: its start plus slurm.time_limit).
    time_left_s: float | None = None
    # Why a queued job still waits (Slurm's ``%r``); None once it runs.
    pending_reason: str | None = None


class CellLauncher(Protocol):
    """One backend's way of running cells (``submit.servecells``)."""

    backend: Literal["local", "slurm"]
    # How much earlier than asked the TERM before the time limit may come (Slurm: 60 s).
    early_signal_s: float

    async def submit(self, job: JobDir) -> CellIds:
        """Write and start the cell's job in ``job`` (a new directory); RuntimeFailure if not."""
        ...

    async def facts(self, cell: CellRecord, job: JobDir) -> CellFacts:
        """Whether the cell's job runs, its time left and why it waits."""
        ...

    async def stop(self, cell: CellRecord, job: JobDir, limit: float) -> None:
        """Stop the cell's job (its agents drain within ``limit`` s); RuntimeFailure if not."""
        ...
