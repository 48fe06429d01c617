"""``tilert-submit status S [--json]``: a service (``tilert-submit serve``), one row per cell.

``status`` takes a service directory as it takes a job directory (``S/service.json`` tells them
apart, ``agent.service.paths``). The header says the service's state, its front's address and
request counts; the table one cell per row (job, nodes, state, time left, in flight, served, what
follows it or why it waits); below it, each cell still loading shows its job's own progress (its
status.json: the agents' states and the engines' last progress lines), so a successor's load can
be watched from the service. A service.json whose front is gone, or that has not been refreshed
for a while, is reported as stale: its cells may still run (``serve`` again adopts them, ``stop
S`` stops them).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import msgspec

from agent.errors import EXIT_BAD_INPUT, EXIT_OK
from agent.job.plan import load_plan
from agent.job.records import JobStatus
from agent.problems import printable
from agent.service.paths import ServiceDir
from agent.service.records import LIVE_CELL_STATES, CellRecord, ServiceStatus, read_status
from submit.statusview import progress_lines

# The front writes service.json on every change and every few seconds; three missed writes.
STALE_AFTER_S = 15.0
LIVE_SERVICE_STATES = frozenset({"starting", "serving", "degraded", "stopping"})
DETAIL_WIDTH = 60


class ServiceView(msgspec.Struct):
    """``status S --json``: service.json plus the submitter's verdict on staleness."""

    service: ServiceStatus
    stale: bool
    stale_reason: str | None


def read_service(service: ServiceDir) -> ServiceStatus:
    """``S/service.json``, or exit 2 saying why it cannot be used."""
    try:
        return read_status(service.status.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:  # ValidationError is a DecodeError
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        print(
            printable(
                f"tilert-submit: {service.status} is not a usable service status ({reason}); "
                "give the folder tilert-submit serve printed"
            ),
            file=sys.stderr,
        )
        raise SystemExit(EXIT_BAD_INPUT) from None


def front_alive(status: ServiceStatus) -> bool | None:
    """Whether the service front's process still runs: None when it runs on another host (its
    pid means nothing here)."""
    from submit.local.backend import pid_alive

    if status.front_host is not None and status.front_host != socket.gethostname():
        return None
    return pid_alive(status.front_pid)


def staleness(status: ServiceStatus, now: float | None = None) -> str | None:
    """Why a live-looking service.json cannot be believed, or None."""
    if status.state not in LIVE_SERVICE_STATES:
        return None
    if front_alive(status) is False:
        return (
            f"the service front (pid {status.front_pid}) is gone; its cells may still run: "
            "tilert-submit serve on this directory adopts them, tilert-submit stop stops them"
        )
    age = (time.time() if now is None else now) - status.updated_at
    if age > STALE_AFTER_S:
        return (
            f"service.json not refreshed for {age:.0f}s (the service front writes it every few s)"
        )
    return None


def clock(seconds: float | None) -> str:
    """``1:02:03`` (``D-HH:MM:SS`` past a day, as Slurm's ``%L``); ``-`` for none."""
    if seconds is None:
        return "-"
    whole = int(max(0.0, seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}"


def time_left(cell: CellRecord, now: float) -> float | None:
    """The cell's time left now: Slurm's (or the local limit's) last reading less the time since."""
    if cell.state not in LIVE_CELL_STATES or cell.time_left_s is None or cell.time_left_at is None:
        return None  # an ended cell's last reading says nothing now
    return max(0.0, cell.time_left_s - max(0.0, now - cell.time_left_at))


def job_of(cell: CellRecord) -> str:
    """How the backend knows the cell: its Slurm job id, or its local supervisor's pid."""
    if cell.slurm_job_id:
        return cell.slurm_job_id
    if cell.local_pid:
        return f"local {cell.local_pid}"
    return "-"


def nodes_of(service: ServiceDir, cell: CellRecord) -> str:
    """How many nodes the cell's job holds (its plan's), ``-`` when its plan cannot be read."""
    try:
        plan = load_plan(service.cell(cell.name).plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError):
        return "-"
    return str(plan.slurm.nodes)


def follows_cell(cell: CellRecord, cells: list[CellRecord]) -> str:
    """What comes after the cell (its successor or replacement, and its state), or why the cell
    itself still waits (Slurm's pending reason); what it was started for otherwise."""
    after = [c for c in cells if c.follows == cell.name]
    if after:
        return ", ".join(f"{c.name} {c.reason} ({c.state})" for c in after)
    if cell.state == "submitted" and cell.pending_reason:
        return f"pending: {cell.pending_reason}"
    if cell.follows:
        return f"{cell.reason} of {cell.follows}"
    return "-"


def _row(service: ServiceDir, cell: CellRecord, cells: list[CellRecord], now: float) -> list[str]:
    detail = cell.detail or ""
    if len(detail) > DETAIL_WIDTH:
        detail = detail[: DETAIL_WIDTH - 3] + "..."
    return [
        cell.name,
        job_of(cell),
        nodes_of(service, cell),
        cell.state,
        clock(time_left(cell, now)),
        str(cell.in_flight),
        str(cell.served),
        follows_cell(cell, cells),
        detail,
    ]


def loading_lines(service: ServiceDir, cell: CellRecord, now: float) -> list[str]:
    """A cell still loading: its job's state and agents, and its engines' last progress lines."""
    job = cell_status(service, cell.name)
    if job is None:
        return [f"{cell.name} ({cell.reason}): no readable status.json yet"]
    since = f", {now - cell.submitted_at:.0f}s since submitted"
    agents = ", ".join(f"{a.name} {a.state}" for a in job.agents) or "no agent yet"
    lines = [f"{cell.name} ({cell.reason}{since}): job {job.state}: {agents}"]
    return lines + [f"  {line}" for line in progress_lines(job.agents, now) if line]


def header_lines(status: ServiceStatus, stale: str | None, now: float) -> list[str]:
    """The service's state, front, counts and error."""
    lines = [f"service: {status.state}{' (STALE: ' + stale + ')' if stale else ''}"]
    lines.append(f"name: {status.name}")
    host = f" on {status.front_host}" if status.front_host else ""
    lines.append(f"front: {status.front_url} (pid {status.front_pid}{host}; {status.backend})")
    requests = ", ".join(f"{k} {v}" for k, v in sorted(status.requests.items())) or "none yet"
    lines.append(
        f"requests: {requests}; successions {status.successions}, "
        f"replacements {status.replacements}"
    )
    lines.append(f"updated: {now - status.updated_at:.1f}s ago")
    if status.error:
        lines.append(f"error: {status.error}")
    return lines


def render_service(service: ServiceDir, status: ServiceStatus, stale: str | None) -> str:
    """The human view: the header, one row per cell, each loading cell's progress."""
    now = time.time()
    lines = header_lines(status, stale, now)
    header = ["CELL", "JOB", "NODES", "STATE", "TIME LEFT", "IN FLIGHT", "SERVED", "NEXT", "DETAIL"]
    rows = [header] + [_row(service, c, status.cells, now) for c in status.cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines.append("")
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if not status.cells:
        lines.append("(no cell yet)")
    loading = [c for c in status.cells if c.state in ("submitted", "starting")]
    for cell in loading:
        lines += ["", *loading_lines(service, cell, now)]
    failed = [c for c in status.cells if c.state == "failed" and c.detail]
    if failed:
        lines.append("")
        lines += [f"{c.name} failed: {c.detail}" for c in failed]
    return "\n".join(printable(line) for line in lines)


def main(args: argparse.Namespace) -> int:
    """Print the service's status; 0 whenever service.json could be read, else 2."""
    service = ServiceDir(Path(args.job_dir))
    status = read_service(service)
    stale = staleness(status)
    if getattr(args, "json", False):
        view = ServiceView(service=status, stale=stale is not None, stale_reason=stale)
        print(msgspec.json.encode(view).decode())
    else:
        print(render_service(service, status, stale))
    return EXIT_OK


def cell_status(service: ServiceDir, name: str) -> JobStatus | None:
    """Cell ``name``'s job status.json, or None when it cannot be read."""
    try:
        return service.cell(name).read_status()
    except (OSError, msgspec.DecodeError):
        return None
