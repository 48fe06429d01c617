"""The control plane's rules (agent/service/succession.py): the successor lead (set or measured),
when a successor is due (the TERM margin counted), the lines and their heads, replacements with
backoff and an hourly bound, never more than max_cells live cells."""

from __future__ import annotations

import msgspec

from agent.recipe.serviceplan import SUCCESSOR_LEAD_FACTOR
from agent.service import succession
from agent.service.records import CellRecord
from agent.service.succession import Submission, decide
from tests.kit.service import service_plan as plan

NOW = 10_000.0


def cell(name: str, state: str = "ready", **over: object) -> CellRecord:
    record = CellRecord(name=name, state=state, submitted_at=NOW - 500)  # type: ignore[arg-type]
    return msgspec.structs.replace(record, **over)


def test_a_new_service_submits_its_cells_within_max_cells() -> None:
    assert decide(plan(cells=2, max_cells=3), [], NOW, 0).submit == [
        Submission("initial", None),
        Submission("initial", None),
    ]
    assert decide(plan(), [cell("cell-1", "starting")], NOW, 0).submit == []


def test_auto_lead_is_the_last_load_times_the_factor_plus_its_queue_wait_and_the_margin() -> None:
    cells = [
        cell("cell-1", submitted_at=0.0, started_at=10.0, ready_at=110.0),
        # The last to become ready: queued 30 s, loaded 200 s.
        cell("cell-2", submitted_at=500.0, started_at=530.0, ready_at=730.0),
    ]
    auto = plan(successor_lead_s=None)
    assert succession.lead_s(auto, cells, 80.0) == 200 * SUCCESSOR_LEAD_FACTOR + 30 + 80
    assert succession.lead_s(auto, [], 0.0) == succession.AUTO_FIRST_LEAD_S
    # A lead the recipe sets counts back from the end as it is.
    assert succession.lead_s(plan(), cells, 80.0) == 60.0


def test_successor_due_counts_the_age_of_the_reading() -> None:
    one = cell("cell-1", time_left_s=200.0, time_left_at=NOW - 50)  # 150 s left now
    assert not succession.successor_due(one, NOW, 149.0)
    assert succession.successor_due(one, NOW, 150.0)
    assert succession.successor_due(one, NOW + 90, 60.0)
    assert not succession.successor_due(cell("cell-1"), NOW, 60.0)  # no limit known
    retiring = cell("cell-1", "retiring", time_left_s=1.0, time_left_at=NOW)
    assert not succession.successor_due(retiring, NOW, 60.0)


def test_an_auto_lead_submits_before_the_term_margin() -> None:
    loaded = cell(
        "cell-1",
        submitted_at=NOW - 100,
        started_at=NOW - 100,
        ready_at=NOW - 60,
        time_left_s=150.0,
        time_left_at=NOW,
    )
    auto = plan(successor_lead_s=None)
    # Loaded in 40 s: 60 s of lead, plus a TERM margin of 80 s: due at 140 s left, not at 150.
    assert decide(auto, [loaded], NOW, 80.0).submit == []
    assert decide(auto, [loaded], NOW + 10, 80.0).submit == [Submission("successor", "cell-1")]


def test_one_successor_per_cell_and_none_beyond_max_cells() -> None:
    due = cell("cell-1", time_left_s=30.0, time_left_at=NOW)
    assert decide(plan(), [due], NOW, 0).submit == [Submission("successor", "cell-1")]
    # Its successor is loading: nothing more.
    loading = cell("cell-2", "starting", reason="successor", follows="cell-1")
    assert decide(plan(), [due, loading], NOW, 0).submit == []
    # max_cells reached by a retiring cell: the successor waits and says why.
    retiring = cell("cell-0", "retiring")
    decided = decide(plan(), [retiring, due], NOW, 0)
    assert decided.submit == []
    assert decided.held is not None
    assert "max_cells" in decided.held


def test_a_failed_cell_is_replaced_after_the_backoff() -> None:
    failed = cell("cell-1", "failed", ended_at=NOW - 5)
    decided = decide(plan(), [failed], NOW, 0)
    assert decided.submit == []
    assert decided.held is not None
    assert "backoff" in decided.held
    assert decide(plan(), [failed], NOW + 5, 0).submit == [Submission("replacement", "cell-1")]
    # Replaced already (its replacement loads): nothing more.
    replacing = cell("cell-2", "starting", reason="replacement", follows="cell-1")
    assert decide(plan(), [failed, replacing], NOW + 5, 0).submit == []


def test_a_cell_failed_while_its_successor_loads_needs_no_replacement() -> None:
    failed = cell("cell-1", "failed", ended_at=NOW)
    successor = cell("cell-2", "starting", reason="successor", follows="cell-1")
    assert decide(plan(), [failed, successor], NOW + 100, 0).submit == []


def test_replacements_back_off_doubling_and_stop_at_the_hourly_bound() -> None:
    assert succession.replacement_wait_s(plan(), 0) == 10.0
    assert succession.replacement_wait_s(plan(), 3) == 80.0
    assert succession.replacement_wait_s(plan(), 20) == 600.0
    history = [
        cell(f"cell-{i}", "failed", reason="replacement", submitted_at=NOW - 100, ended_at=NOW - 50)
        for i in range(1, 3)
    ]
    history[1].follows = "cell-1"
    last = history[-1]
    # Two in the hour: the third waits 10 * 2**2 s after the last failure.
    assert decide(plan(), history, NOW - 50 + 39, 0).submit == []
    assert decide(plan(), history, NOW - 50 + 40, 0).submit == [
        Submission("replacement", last.name)
    ]
    bounded = decide(plan(replace_max_per_hour=2), history, NOW + 1000, 0)
    assert bounded.submit == []
    assert bounded.held is not None
    assert "max_per_hour" in bounded.held


def test_a_failed_successor_is_retried_with_the_backoff_while_its_predecessor_serves() -> None:
    old = cell("cell-1", time_left_s=30.0, time_left_at=NOW)
    failed = cell("cell-2", "failed", reason="successor", follows="cell-1", ended_at=NOW - 2)
    assert decide(plan(), [old, failed], NOW, 0).submit == []
    assert decide(plan(), [old, failed], NOW + 8, 0).submit == [Submission("successor", "cell-1")]


def test_heads_are_the_newest_live_cell_of_each_line() -> None:
    cells = [
        cell("cell-1", "retiring"),
        cell("cell-2", "ready", reason="successor", follows="cell-1"),
        cell("cell-3", "ready"),
        cell("cell-4", "submitted", reason="successor", follows="cell-3"),
    ]
    assert [c.name for c in succession.heads(cells)] == ["cell-2", "cell-4"]
    assert len(succession.live(cells)) == 4
