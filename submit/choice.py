"""Which backend runs a job: Slurm or this machine (``--local``).

Apart from ``submit.backend`` (the interface the backends implement), so that the backends can
import the interface without importing each other.
"""

from __future__ import annotations

from agent.job.records import JobStatus
from submit.backend import Backend


def backend_of(status: JobStatus) -> Backend | None:
    """The backend that runs the job ``status.json`` describes; None before one started it."""
    # Slurm first: the id is recorded at submission, before any agent runs.
    for pick in (_slurm, _local):
        backend = pick()
        if backend.owns(status):
            return backend
    return None


def backend_for(*, local: bool) -> Backend:
    """The backend a new job is submitted to: this machine with ``--local``, else Slurm."""
    return _local() if local else _slurm()


# Imported when picked: a job command loads only its own backend (and Slurm's client or trio).
def _slurm() -> Backend:
    from submit.slurm.backend import SlurmBackend

    return SlurmBackend()


def _local() -> Backend:
    from submit.local.backend import LocalBackend

    return LocalBackend()
