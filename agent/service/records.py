"""``S/service.json``: what the service front says about the service and each of its cells.

Written atomically by the service front on every change and every few seconds; read by
``tilert-submit status/logs/stop S`` and by a restarted front, which adopts the cells it names
that still run (a cell's job id, or its local supervisor's pid and start time).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from agent.job.records import PID_MAX

ServiceState = Literal["starting", "serving", "degraded", "stopping", "stopped", "failed"]
# submitted: handed to Slurm (or started locally), not running yet (``pending_reason`` says why);
# starting: its job runs, not ready; ready: takes new requests; retiring: a successor took its
# place, no new request, its streams run on up to ``service.drain_s``; ended: stopped by the
# service; failed: its job failed or ended early (``reason`` says why).
CellState = Literal["submitted", "starting", "ready", "retiring", "ended", "failed"]
LIVE_CELL_STATES: frozenset[CellState] = frozenset({"submitted", "starting", "ready", "retiring"})
# Why a cell was started: one of the first ``service.cells``, a successor of a cell nearing its
# time limit, or a replacement of a failed one.
CellReason = Literal["initial", "successor", "replacement"]


class CellRecord(msgspec.Struct, kw_only=True):
    """One cell: an ordinary job under ``S/cells/NAME``."""

    name: str
    reason: CellReason = "initial"
    # The cell this one succeeds or replaces.
    follows: str | None = None
    state: CellState = "submitted"
    # How the backend knows it (as the job's status.json says; one of the two).
    slurm_job_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,20}$")] | None = None
    local_pid: Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)] | None = None
    local_started_at: float | None = None
    submitted_at: float = msgspec.field(default_factory=time.time)
    started_at: float | None = None
    ready_at: float | None = None
    # Slurm's time left (``squeue -o %L``) when last read, and when that was.
    time_left_s: float | None = None
    time_left_at: float | None = None
    # The cell's front door (its status.json ``front_url``) and its ready decodes.
    front_url: str | None = None
    decodes: int = 0
    # The service front's requests at this cell now, and served in all.
    in_flight: int = 0
    served: int = 0
    # Slurm's reason a submitted cell still waits (``squeue -o %r``): Resources, Priority, ...
    pending_reason: str | None = None
    # What the cell's job is doing while it starts (its status.json state and error), or why it
    # failed or was retired.
    detail: str | None = None
    ended_at: float | None = None


class ServiceStatus(msgspec.Struct, kw_only=True):
    """``S/service.json``."""

    state: ServiceState
    name: str
    front_url: str
    front_pid: Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)]
    front_started_at: float
    # The host the front runs on (``socket.gethostname()``): its pid means something there only.
    front_host: str | None = None
    backend: Literal["local", "slurm"]
    cells: list[CellRecord] = []
    # outcome (ok, failed, truncated, rejected, cancelled, lost) -> requests since the service
    # began (a restarted front carries them on).
    requests: dict[str, int] = {}
    successions: int = 0
    replacements: int = 0
    updated_at: float = msgspec.field(default_factory=time.time)
    error: str | None = None


def read_status(data: bytes) -> ServiceStatus:
    """``service.json``'s bytes decoded (``msgspec.ValidationError``/``DecodeError`` if bad)."""
    return msgspec.json.decode(data, type=ServiceStatus)
