"""The control plane's rules (docs/service.md, "Successions" and "Replacement"): pure functions of
the service plan, the cells' records and the time, so the keeper only acts on what they say.

- The **lead**: how long before a cell's end its successor is submitted
  (``service.successor_lead_s``, or ``auto``: the last cell's submit-to-ready time x
  ``SUCCESSOR_LEAD_FACTOR`` plus the time it waited in Slurm's queue, plus the TERM margin).
- A cell's **TERM margin**: the TERM lead its job was given (``--signal``) plus the minute by
  which Slurm may send that TERM early; a measured lead adds it (traffic must have moved by then).
- **Lines**: each of ``service.cells`` lines is one cell at a time, its successors and
  replacements following it (``CellRecord.follows``); a line whose newest live cell is gone needs
  a replacement.
- At most ``max_cells`` live cells at once; replacements back off (doubling), bounded per hour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.recipe.serviceplan import SUCCESSOR_LEAD_FACTOR, ServicePlan
from agent.service.records import LIVE_CELL_STATES, CellReason, CellRecord

# ``auto`` before any cell was ever ready (nothing measured yet): a first guess of the load time.
AUTO_FIRST_LEAD_S = 600.0
HOUR_S = 3600.0
# States in which a cell still heads its line (it serves, or will): not retiring, not over.
_HEADING = frozenset({"submitted", "starting", "ready"})


@dataclass(frozen=True)
class Submission:
    """A cell to submit now: why, and the cell it follows (None for an initial cell)."""

    reason: CellReason
    follows: str | None


def lead_s(plan: ServicePlan, cells: Sequence[CellRecord], term_margin_s: float) -> float:
    """The successor lead, counted back from a cell's end: the recipe's, or (``auto``) the last
    cell that became ready's submit-to-ready time x SUCCESSOR_LEAD_FACTOR plus its wait in the
    queue, plus ``term_margin_s`` (the successor must be ready before the old cell's TERM)."""
    if plan.successor_lead_s is not None:
        return plan.successor_lead_s
    ready = [c for c in cells if c.ready_at is not None]
    if not ready:
        return AUTO_FIRST_LEAD_S + term_margin_s
    last = max(ready, key=lambda c: c.ready_at or 0.0)
    load = (last.ready_at or 0.0) - (last.started_at or last.submitted_at)
    queued = (last.started_at or last.submitted_at) - last.submitted_at
    return max(load, 0.0) * SUCCESSOR_LEAD_FACTOR + max(queued, 0.0) + term_margin_s


def time_left_s(cell: CellRecord, now: float) -> float | None:
    """Seconds until the cell's end (its last reading, aged); None when unknown (no limit)."""
    if cell.time_left_s is None or cell.time_left_at is None:
        return None
    return cell.time_left_s - (now - cell.time_left_at)


def followers(cells: Sequence[CellRecord], name: str) -> list[CellRecord]:
    """The cells that follow ``name`` (its successors and replacements), oldest first."""
    return [c for c in cells if c.follows == name]


def _live_follower(cells: Sequence[CellRecord], name: str) -> CellRecord | None:
    for cell in followers(cells, name):
        if cell.state in _HEADING:
            return cell
    return None


def heads(cells: Sequence[CellRecord]) -> list[CellRecord]:
    """The newest live cell of each line: one that serves or will, with no live cell after it."""
    return [c for c in cells if c.state in _HEADING and _live_follower(cells, c.name) is None]


def live(cells: Sequence[CellRecord]) -> list[CellRecord]:
    """The cells that hold (or wait for) nodes: submitted, starting, ready, retiring."""
    return [c for c in cells if c.state in LIVE_CELL_STATES]


def successor_due(cell: CellRecord, now: float, lead: float) -> bool:
    """Whether ``cell`` (ready, heading its line) should get its successor now: its end is at
    most ``lead`` away."""
    if cell.state != "ready":
        return False
    left = time_left_s(cell, now)
    return left is not None and left <= lead


def replacements_in_hour(cells: Sequence[CellRecord], now: float) -> int:
    """Replacements submitted in the last hour."""
    return sum(1 for c in cells if c.reason == "replacement" and now - c.submitted_at < HOUR_S)


def replacement_wait_s(plan: ServicePlan, recent: int) -> float:
    """The backoff before the next replacement, ``recent`` replacements having been made in the
    hour: ``replace.backoff_s`` doubled each time, at most ``replace.backoff_max_s``."""
    return min(plan.replace_backoff_s * 2.0 ** min(recent, 30), plan.replace_backoff_max_s)


def _orphans(cells: Sequence[CellRecord]) -> list[CellRecord]:
    """Failed cells whose line has no live cell after them: the ones to replace, oldest first."""
    out = []
    for cell in cells:
        if cell.state != "failed":
            continue
        if followers(cells, cell.name):
            continue  # its line goes on (or ended) in the cells after it
        # A failed successor whose predecessor still heads its line is not an orphan: the
        # predecessor serves and gets a new successor (with the backoff) instead.
        if cell.reason == "successor" and any(
            c.name == cell.follows and c.state in _HEADING for c in cells
        ):
            continue
        out.append(cell)
    return out


@dataclass(frozen=True)
class Plan:
    """What to submit now, and why nothing more (a bound reached), for ``service.json``."""

    submit: list[Submission]
    # Why a needed cell is not submitted yet (backoff, the per-hour bound, max_cells).
    held: str | None = None


def decide(
    plan: ServicePlan, cells: Sequence[CellRecord], now: float, term_margin_s: float
) -> Plan:
    """The cells to submit now: the first ``service.cells``, successors of cells nearing their
    end, replacements of failed cells (after the backoff, within the hour's bound), never more
    than ``max_cells`` live at once."""
    room = plan.max_cells - len(live(cells))
    out: list[Submission] = []
    held: str | None = None
    recent = replacements_in_hour(cells, now)
    lead = lead_s(plan, cells, term_margin_s)
    for cell in heads(cells):
        if not successor_due(cell, now, lead):
            continue
        failed_before = [f for f in followers(cells, cell.name) if f.state == "failed"]
        if failed_before:
            # Its last successor failed: the next one backs off as a replacement would.
            last_end = max(f.ended_at or f.submitted_at for f in failed_before)
            wait = replacement_wait_s(plan, recent)
            if now < last_end + wait:
                held = f"{cell.name}'s next successor waits {last_end + wait - now:.0f} s (backoff)"
                continue
        if room <= 0:
            held = f"{cell.name}'s successor waits: max_cells ({plan.max_cells}) cells are live"
            continue
        out.append(Submission("successor", cell.name))
        room -= 1
    missing = max(plan.cells - len(heads(cells)), 0)
    orphans = _orphans(cells)[:missing]
    # Lines with no failed cell to replace (a new service, or one stopped and served again).
    for _ in range(min(missing - len(orphans), room)):
        out.append(Submission("initial", None))
        room -= 1
    for orphan in orphans:
        if recent >= plan.replace_max_per_hour:
            held = (
                f"{orphan.name} is not replaced: {recent} replacements in the last hour "
                f"(service.replace.max_per_hour is {plan.replace_max_per_hour})"
            )
            break
        wait = replacement_wait_s(plan, recent)
        failed_at = orphan.ended_at or orphan.submitted_at
        if now < failed_at + wait:
            held = f"{orphan.name}'s replacement waits {failed_at + wait - now:.0f} s (backoff)"
            continue
        if room <= 0:
            held = f"{orphan.name}'s replacement waits: max_cells ({plan.max_cells}) cells are live"
            break
        out.append(Submission("replacement", orphan.name))
        room -= 1
        recent += 1
    return Plan(out, held)
