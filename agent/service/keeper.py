"""``CellKeeper``: the service front's control plane (docs/service.md).

Every ``POLL_S`` (and at once when poked) it reads each live cell's ``J/status.json`` (ready? its
front door, its ready decodes, its error) and what the backend says of its job (running? time
left? why pending?), moves the cell through its states, hands the table to the data plane
(``front.set_cells``), acts on ``agent.service.succession``'s decisions (the first cells,
successors, replacements), retires a cell once its successor is ready (no new request; it is
stopped when its streams are done, after ``drain_s``, or at its end), cuts a failed cell's streams,
and writes ``S/service.json`` and ``S/targets.json``. Started on a directory whose
``service.json`` names live cells, it adopts them: nothing is submitted twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import trio

from agent.errors import RuntimeFailure
from agent.job.atomicfile import write_atomic
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.job.records import JobStatus
from agent.job.vocab import SERVING_STATES
from agent.recipe.serviceplan import ServicePlan
from agent.service import succession
from agent.service.launcher import CellLauncher
from agent.service.paths import ServiceDir
from agent.service.records import (
    LIVE_CELL_STATES,
    CellRecord,
    ServiceState,
    ServiceStatus,
    read_status,
)

POLL_S = 2.0
# How long a cell's agents may take to drain when the service stops it.
STOP_LIMIT_S = 120.0
# Job states in which a cell no longer serves: its job ends (TERM came, or it failed).
_ENDING = frozenset({"stopping", "stopped", "failed"})

log = logging.getLogger("tilert.service")


class FrontControl(Protocol):
    """What the keeper asks of the data plane (``agent.service.front.ServiceFront``)."""

    def set_cells(self, cells: Sequence[CellRecord]) -> None: ...
    def cut(self, name: str) -> None: ...
    def in_flight(self, name: str) -> int: ...
    def served(self, name: str) -> int: ...
    def requests(self) -> dict[str, int]: ...
    def carry(self, requests: Mapping[str, int]) -> None: ...
    def serving(self) -> bool: ...


class FiguresControl(Protocol):
    """The control plane's series (``agent.service.figures.ServiceFigures``)."""

    def cells(self, states: Mapping[str, int]) -> None: ...
    def succession(self) -> None: ...
    def replacement(self) -> None: ...


def ready_decodes(status: JobStatus) -> int:
    """The cell's decodes that serve: those in its router's list (its front door's capacity:
    one restarting for a moment stays, and the cell's own front door waits for it), or, before
    the head says who is, the healthy ones."""
    return sum(
        1
        for a in status.agents
        if a.role == "decode"
        and (a.pool == "member" or (a.pool is msgspec.UNSET and a.state == "healthy"))
    )


def serves(cell: CellRecord, status: JobStatus | None) -> bool:
    """Whether the cell's job serves: ready (or degraded), a front door, a ready decode."""
    return (
        status is not None
        and status.state in SERVING_STATES
        and cell.front_url is not None
        and cell.decodes > 0
    )


def term_margin_s(job: JobDir, early_signal_s: float) -> float | None:
    """How long before its end a cell's job gets its TERM at the earliest: its plan's signal lead
    plus how early the backend may send it; None while its plan cannot be read."""
    try:
        plan = load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError):
        return None
    return plan.slurm.signal_lead_s + early_signal_s


def _read_job(job: JobDir) -> JobStatus | None:
    try:
        return job.read_status()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_service(sdir: ServiceDir) -> ServiceStatus | None:
    """``S/service.json`` as a previous front left it, or None (none, or unreadable)."""
    try:
        return read_status(sdir.status.read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


class CellKeeper:
    """Keeps ``plan.cells`` cells serving behind ``front`` (the module docstring)."""

    def __init__(
        self,
        sdir: ServiceDir,
        plan: ServicePlan,
        launcher: CellLauncher,
        front: FrontControl,
        figures: FiguresControl,
        *,
        name: str,
        front_url: str,
        poll_s: float = POLL_S,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.sdir = sdir
        self.plan = plan
        self.launcher = launcher
        self.front = front
        self.figures = figures
        self.poll_s = poll_s
        self.now = now
        self.cells: list[CellRecord] = []
        self.state: ServiceState = "starting"
        self.held: str | None = None
        self.successions = 0
        self.replacements = 0
        self.adopted: list[str] = []
        self._status = ServiceStatus(
            state="starting",
            name=name,
            front_url=front_url,
            front_pid=1,
            front_started_at=now(),
            backend=launcher.backend,
        )
        self._next = 1
        self._retiring_since: dict[str, float] = {}
        # Cells being stopped: set once each stop is over.
        self._stops: dict[str, trio.Event] = {}
        self._margins: dict[str, float] = {}
        self._routed: object = None
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    # -- adoption ---------------------------------------------------------------------------

    async def adopt(self) -> None:
        """Take over the cells ``S/service.json`` names: the live ones whose jobs still run are
        kept, the others marked as they ended; the request counts carried on."""
        old = read_service(self.sdir)
        if old is None:
            return
        self.front.carry(old.requests)
        self.successions, self.replacements = old.successions, old.replacements
        self.cells = list(old.cells)
        for cell in self.cells:
            self._next = max(self._next, _number(cell.name) + 1)
            if cell.state not in LIVE_CELL_STATES:
                continue
            facts = await self.launcher.facts(cell, self.sdir.cell(cell.name))
            if facts.running is False:
                ended = "ended" if cell.state == "retiring" else "failed"
                self._end(cell, ended, "its job ended while no service front ran")
                continue
            self.adopted.append(cell.name)
            if cell.state == "retiring":
                self._retiring_since[cell.name] = self.now()
        if self.adopted:
            log.info("adopted cells %s from %s", ", ".join(self.adopted), self.sdir.status)

    # -- the loop ---------------------------------------------------------------------------

    def poke(self) -> None:
        """Look at the cells now rather than at the next poll."""
        self._wake.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt, then keep the cells until cancelled (``stop`` first to end them)."""
        await self.adopt()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.tick()
            task_status.started()
            while True:
                with trio.move_on_after(self.poll_s):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.tick()

    async def tick(self) -> None:
        """One look at every cell, then the decisions, the table to the front, the files."""
        now = self.now()
        for cell in list(self.cells):
            if cell.state in LIVE_CELL_STATES and cell.name not in self._stops:
                await self._observe(cell, now)
        for cell in self.cells:
            if cell.state == "retiring":
                self._maybe_stop_retiring(cell, now)
        if self.state not in ("stopping", "stopped"):
            self._submit_due(now)
        self._route()
        self.write()

    # -- one cell ---------------------------------------------------------------------------

    async def _observe(self, cell: CellRecord, now: float) -> None:
        job = self.sdir.cell(cell.name)
        if cell.slurm_job_id is None and cell.local_pid is None:
            return  # its submission is under way
        facts = await self.launcher.facts(cell, job)
        status = _read_job(job)
        if facts.time_left_s is not None:
            cell.time_left_s, cell.time_left_at = facts.time_left_s, now
        cell.pending_reason = facts.pending_reason
        job_state = status.state if status is not None else None
        if status is not None:
            cell.front_url = status.front_url
            cell.decodes = ready_decodes(status)
            if cell.state in ("submitted", "starting"):
                cell.detail = f"job {job_state}" + (f": {status.error}" if status.error else "")
        if cell.state == "retiring":
            if facts.running is False:
                self._end(cell, "ended", cell.detail)
            return
        if facts.running is False or job_state in _ENDING:
            why = (status.error if status is not None else None) or (
                f"its job is {job_state}" if job_state in _ENDING else "its job is gone"
            )
            self._fail(cell, why, still_running=facts.running is True)
            return
        if cell.state == "submitted" and job_state not in (None, "pending"):
            cell.state, cell.started_at = "starting", now
            cell.pending_reason = None
        if cell.state == "starting" and serves(cell, status):
            self._ready(cell, now)

    def _ready(self, cell: CellRecord, now: float) -> None:
        cell.state, cell.ready_at, cell.detail = "ready", now, None
        log.info("%s is ready (%s)", cell.name, cell.front_url)
        if cell.reason != "successor" or cell.follows is None:
            return
        old = next((c for c in self.cells if c.name == cell.follows), None)
        if old is None or old.state != "ready":
            return
        old.state, old.detail = "retiring", f"succeeded by {cell.name}"
        self._retiring_since[old.name] = now
        self.successions += 1
        self.figures.succession()
        log.info("succession: %s takes %s's place; %s drains", cell.name, old.name, old.name)

    def _fail(self, cell: CellRecord, why: str, *, still_running: bool) -> None:
        log.warning("%s failed: %s", cell.name, why)
        self.front.cut(cell.name)
        self._end(cell, "failed", why)
        if still_running:
            self._start_stop(cell, then=None)

    def _end(self, cell: CellRecord, state: str, detail: str | None) -> None:
        cell.state = "failed" if state == "failed" else "ended"
        cell.detail, cell.ended_at = detail, self.now()
        cell.decodes = 0
        self._retiring_since.pop(cell.name, None)

    def _maybe_stop_retiring(self, cell: CellRecord, now: float) -> None:
        since = self._retiring_since.setdefault(cell.name, now)
        if cell.name in self._stops:
            return
        drained = self.front.in_flight(cell.name) == 0
        if drained or now - since >= self.plan.drain_s:
            why = "its streams are done" if drained else f"drain_s ({self.plan.drain_s:g} s) passed"
            log.info("stopping retired %s: %s", cell.name, why)
            self._start_stop(cell, then="ended")

    def _start_stop(self, cell: CellRecord, *, then: str | None) -> None:
        """Stop the cell's job in the background; mark it ``then`` once stopped."""
        self._stops[cell.name] = trio.Event()
        self._spawn(self._stop_cell, cell, then)

    async def _stop_cell(
        self, cell: CellRecord, then: str | None, limit: float = STOP_LIMIT_S
    ) -> None:
        try:
            await self.launcher.stop(cell, self.sdir.cell(cell.name), limit)
        except RuntimeFailure as exc:
            log.warning("could not stop %s: %s", cell.name, exc)
        finally:
            done = self._stops.pop(cell.name, None)
            if done is not None:
                done.set()
        if then is not None and cell.state in LIVE_CELL_STATES:
            self._end(cell, then, cell.detail)
        self.poke()

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Run ``fn`` beside the loop (``run``'s nursery)."""
        if self._nursery is None:
            raise RuntimeError("the keeper is not running")
        self._nursery.start_soon(fn, *args)

    # -- submissions ------------------------------------------------------------------------

    def _term_margin(self, cell: CellRecord) -> float:
        margin = self._margins.get(cell.name)
        if margin is None:
            margin = term_margin_s(self.sdir.cell(cell.name), self.launcher.early_signal_s)
            if margin is None:
                return self.launcher.early_signal_s
            self._margins[cell.name] = margin
        return margin

    def _submit_due(self, now: float) -> None:
        margin = max((self._term_margin(c) for c in succession.live(self.cells)), default=0.0)
        decided = succession.decide(self.plan, self.cells, now, margin)
        self.held = decided.held
        for one in decided.submit:
            cell = CellRecord(
                name=f"cell-{self._next}", reason=one.reason, follows=one.follows, submitted_at=now
            )
            self._next += 1
            self.cells.append(cell)
            if one.reason == "replacement":
                self.replacements += 1
                self.figures.replacement()
            log.info("submitting %s (%s of %s)", cell.name, one.reason, one.follows or "none")
            self._spawn(self._submit, cell)

    async def _submit(self, cell: CellRecord) -> None:
        try:
            ids = await self.launcher.submit(self.sdir.cell(cell.name))
        except RuntimeFailure as exc:
            self._end(cell, "failed", f"not submitted: {exc}")
            self.poke()
            return
        cell.slurm_job_id = ids.slurm_job_id
        cell.local_pid, cell.local_started_at = ids.local_pid, ids.local_started_at
        self.poke()

    # -- the whole service ------------------------------------------------------------------

    def _route(self) -> None:
        for cell in self.cells:
            # Every cell's, ended ones too: a failed cell's cut streams leave its count at 0.
            cell.in_flight = self.front.in_flight(cell.name)
            cell.served = self.front.served(cell.name)
        routed = [(c.name, c.state, c.front_url, c.decodes) for c in self.cells]
        if routed != self._routed:
            self._routed = routed
            self.front.set_cells([msgspec.structs.replace(c) for c in self.cells])
        counts = Counter(c.state for c in self.cells if c.state in LIVE_CELL_STATES)
        self.figures.cells({s: counts.get(s, 0) for s in LIVE_CELL_STATES})
        if self.state in ("stopping", "stopped"):
            return
        ready = sum(1 for c in self.cells if c.state == "ready")
        self.state = "serving" if ready >= self.plan.cells else "degraded" if ready else "starting"

    def write(self) -> None:
        """``S/service.json`` and ``S/targets.json``, atomically."""
        status = msgspec.structs.replace(
            self._status,
            state=self.state,
            cells=self.cells,
            requests=self.front.requests(),
            successions=self.successions,
            replacements=self.replacements,
            updated_at=time.time(),
            error=self.held,
        )
        write_atomic(self.sdir.status, msgspec.json.format(msgspec.json.encode(status)) + b"\n")
        targets = targets_json(self.sdir, status, succession.live(self.cells))
        write_atomic(self.sdir.targets, targets)

    def set_front(self, *, pid: int, started_at: float, host: str) -> None:
        """Name this front's process in ``service.json`` (``stop S`` signals it)."""
        self._status = msgspec.structs.replace(
            self._status, front_pid=pid, front_started_at=started_at, front_host=host
        )

    async def stop(self) -> None:
        """Stop every live cell (each drains), then mark the service stopped."""
        self.state = "stopping"
        self._route()
        self.write()
        under_way = list(self._stops.values())
        async with trio.open_nursery() as nursery:
            for cell in succession.live(self.cells):
                if cell.name not in self._stops:
                    self._stops[cell.name] = trio.Event()
                    nursery.start_soon(self._stop_cell, cell, "ended")
        # Cells whose stop was already under way (a retiring one) end with it.
        with trio.move_on_after(STOP_LIMIT_S):
            for done in under_way:
                await done.wait()
        self.state = "stopped"
        self._route()
        self.write()


def targets_json(sdir: ServiceDir, status: ServiceStatus, cells: Sequence[CellRecord]) -> bytes:
    """``S/targets.json``: the service front, then every target of each cell's own targets.json
    (labelled with its cell), for Prometheus' file_sd."""
    url = status.front_url.split("://", 1)[-1].rstrip("/")
    out: list[dict[str, Any]] = [{"targets": [url], "labels": {"service": status.name}}]
    for cell in cells:
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            groups = msgspec.json.decode(
                sdir.cell(cell.name).targets.read_bytes(), type=list[dict[str, Any]]
            )
            for group in groups:
                labels = {**group.get("labels", {}), "cell": cell.name}
                out.append({**group, "labels": labels})
    return msgspec.json.encode(out) + b"\n"


def _number(name: str) -> int:
    """N of ``cell-N`` (0 for a name of another shape)."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
