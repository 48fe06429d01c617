"""The service front's routing in process (agent/service/front.py, cellslots.py, figures.py): the
cells of tests/kit/servicecells.py (their front doors on an ``httpx.MockTransport``), requests
through the ASGI app with no socket, on trio's autojump clock.

Which cell takes a request (a ready one with a free decode, the least loaded), how many at once
(its decodes), the one FIFO queue when none is free and its bounds, and the figures. A cell
leaving, a cell cut, a stream continued or marked: tests/test_service_cuts.py. The same with
real jobs as cells: tests/test_service_front.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from agent.front.openai import CHAT
from agent.front.sse import DONE
from agent.front.upstream import H11Upstream
from agent.job.frontpolicy import FrontPolicy
from agent.service.figures import ServiceFigures
from agent.service.front import ServiceFront
from agent.service.records import CellState
from tests.kit.front import (
    ROLE,
    Client,
    Reply,
    call,
    chat_body,
    chunk,
    events,
    whole,
)
from tests.kit.metrics import samples
from tests.kit.servicecells import ANSWER, MODELS, ServiceKit, gated, start, text
from tests.kit.waiting import until

# ---- which cell, how many ----------------------------------------------------------------------


async def test_requests_go_to_free_decodes_least_loaded_cell_first(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    gate = trio.Event()
    for name, decodes in (("cell-1", 1), ("cell-2", 2)):
        kit.cell(name, decodes).script(gated(gate))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        for tag in ("r1", "r2", "r3", "r4"):
            await start(kit, nursery, tag, got)
        # 3 decodes in all: the 4th waits at the front, not at a cell.
        assert (kit.front.in_flight("cell-1"), kit.front.in_flight("cell-2")) == (1, 2)
        assert kit.front.slots.admission.waiting == 1
        assert sorted(kit.at("cell-1") + kit.at("cell-2")) == ["r1", "r2", "r3"]
        gate.set()
    assert {tag: text(reply) for tag, reply in got.items()} == dict.fromkeys(got, "Hello world")
    assert kit.outcomes() == {"ok": 4}
    assert len(kit.at("cell-1")) + len(kit.at("cell-2")) == 4
    assert kit.front.served("cell-1") + kit.front.served("cell-2") == 4
    assert kit.front.in_flight("cell-1") == kit.front.in_flight("cell-2") == 0
    assert kit.front.slots.admission.admitted == 0


async def test_a_client_that_leaves_on_reading_done_was_served() -> None:
    # Clients close the moment they read [DONE], before the response's own end: such a stream
    # was served whole (counted cancelled before, 96 of ~1,200 in the service benchmark).
    kit = ServiceKit()
    kit.cell("cell-1").script(events(ROLE, chunk("Hello"), chunk(None, "stop"), DONE))
    reply = await call(kit.front.app, "POST", CHAT, Client((chat_body(),), leave_on=b"[DONE]"))
    assert reply.events()[-1] == DONE
    assert kit.outcomes() == {"ok": 1}


async def test_equal_cells_take_turns(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    for name in ("cell-1", "cell-2"):
        kit.cell(name, 2).script(whole(ANSWER))
    for tag in ("r1", "r2", "r3", "r4"):
        reply = await kit.chat(tag, stream=False)
        assert (reply.status, reply.json()) == (200, ANSWER)
    assert (kit.at("cell-1"), kit.at("cell-2")) == (["r1", "r3"], ["r2", "r4"])
    assert kit.front.served("cell-1") == kit.front.served("cell-2") == 2


async def test_a_cells_served_count_carries_on_from_its_record_when_first_seen(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    kit.cell("cell-1", 1, served=5).script(whole(ANSWER))  # as a restarted front sees it
    assert kit.front.served("cell-1") == 5
    assert (await kit.chat("r1", stream=False)).status == 200
    assert kit.front.served("cell-1") == 6
    kit.records["cell-1"].served = 6  # the keeper wrote what the front said: not added again
    kit.table()
    assert kit.front.served("cell-1") == 6
    assert kit.front.served("cell-9") == kit.front.in_flight("cell-9") == 0


@pytest.mark.parametrize(
    ("state", "front_url", "decodes"),
    [("starting", True, 1), ("ready", False, 1), ("ready", True, 0), ("retiring", True, 1)],
)
async def test_only_a_ready_cell_with_an_address_and_decodes_serves(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    state: CellState,
    front_url: bool,
    decodes: int,
) -> None:
    kit = ServiceKit()
    kit.cell("cell-1", decodes, state)
    if not front_url:
        kit.records["cell-1"].front_url = None
        kit.table()
    assert not kit.front.serving()
    health = await kit.get("/health")
    assert health.status == 503
    assert health.headers["retry-after"]
    refused_ = await kit.chat("r1")
    assert refused_.status == 503
    assert refused_.error()["type"] == "unavailable"
    assert kit.doors["cell-1"].seen == []
    assert kit.outcomes() == {"rejected": 1}
    kit.cell("cell-1", 1, "ready").script(whole(ANSWER))
    assert kit.front.serving()
    assert (await kit.get("/health")).json() == {"status": "ok", "cells": ["cell-1"]}
    assert (await kit.chat("r2", stream=False)).status == 200


async def test_a_request_waits_for_a_cell_that_is_coming_and_is_served_by_it(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    # A cell loading (or a ready one whose decodes dropped out for a moment): a request waits in
    # the queue for it, it is not refused at once.
    kit = ServiceKit()
    kit.cell("cell-1", 0, "starting")
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "r1", got)
        await trio.sleep(30)
        assert kit.front.slots.admission.waiting == 1
        kit.doors["cell-1"].script(events(ROLE, chunk("Hello"), chunk(None, "stop"), DONE))
        kit.cell("cell-1", 1, "ready")
    assert text(got["r1"]) == "Hello"
    assert kit.outcomes() == {"ok": 1}


# ---- the queue ---------------------------------------------------------------------------------


async def test_the_queue_lets_requests_in_in_arrival_order_as_decodes_free(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    gates = {tag: trio.Event() for tag in ("r1", "r2", "r3", "r4")}
    door = kit.cell("cell-1", 1)
    door.script(*(gated(gate) for gate in gates.values()))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        for tag in gates:
            await start(kit, nursery, tag, got)
        assert kit.front.slots.admission.waiting == 3
        for n, tag in enumerate(gates, 1):
            assert kit.at("cell-1") == list(gates)[:n]  # one at the cell at a time
            gates[tag].set()
            await trio.testing.wait_all_tasks_blocked()
    assert kit.outcomes() == {"ok": 4}
    page = samples(kit.figures.page().decode())
    waited = {s.name: s.value for s in page if s.name.startswith("tilert_service_queue_wait")}
    assert waited["tilert_service_queue_wait_seconds_count"] == 4


async def test_past_the_queue_bounds_a_429_with_retry_after(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit(max_waiting=1, max_wait_s=30.0)
    gate = trio.Event()
    kit.cell("cell-1", 1).script(gated(gate))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        for tag in ("r1", "r2", "r3"):
            await start(kit, nursery, tag, got)
        full = got["r3"]  # one waits already: refused at once
        assert full.status == 429
        assert full.error()["reason"] == "full"
        assert int(full.headers["retry-after"]) >= 1
        await until(lambda: "r2" in got, "the waiter's time bound", 60)
        assert got["r2"].status == 429
        assert got["r2"].error()["reason"] == "wait"
        gate.set()
    assert kit.outcomes() == {"ok": 1, "rejected": 2}
    page = samples(kit.figures.page().decode())
    rejected = {
        s.labels["reason"]: s.value for s in page if s.name == "tilert_service_queue_rejected_total"
    }
    assert rejected == {"full": 1, "wait": 1}


# ---- what else it answers, and its figures -----------------------------------------------------


async def test_models_metrics_and_the_counts_carried_on(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    assert (await kit.get("/v1/models")).status == 503
    door = kit.cell("cell-1", 1)
    door.script(whole(MODELS), whole(ANSWER))
    assert (await kit.get("/v1/models")).json() == MODELS
    assert (await kit.chat("r1", stream=False)).status == 200
    no_engine = await call(kit.front.app, "POST", "/v1/embeddings", Client((b"{}",)))
    assert no_engine.status == 404
    kit.front.carry({"ok": 10, "failed": 1})
    assert kit.outcomes() == {"ok": 11, "failed": 1, "rejected": 1}
    kit.figures.cells({"ready": 1, "starting": 1})
    kit.figures.succession()
    kit.figures.replacement()
    page = await kit.get("/metrics")
    assert page.status == 200
    assert page.headers["content-type"].startswith("text/plain")
    got = samples(page.body.decode())

    def value(name: str, **labels: str) -> float:
        found = [s.value for s in got if s.name == name and labels.items() <= s.labels.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    assert value("tilert_service_requests_total", outcome="ok", cell="cell-1") == 1
    assert value("tilert_service_requests_total", outcome="rejected", cell="none") == 1
    assert value("tilert_service_cells", state="ready") == 1
    assert value("tilert_service_cells", state="failed") == 0
    assert value("tilert_service_successions_total") == 1
    assert value("tilert_service_replacements_total") == 1
    assert value("tilert_service_cell_decodes", cell="cell-1") == 1
    assert value("tilert_service_cell_in_flight", cell="cell-1") == 0
    assert value("tilert_service_requests_in_flight") == 0
    assert value("tilert_service_queue_waiting") == 0
    assert value("tilert_service_retries_total", reason="cell_cut") == 0


async def test_its_own_clients_are_the_front_doors_h11_upstream_open_while_it_runs() -> None:
    front = ServiceFront(FrontPolicy(), ServiceFigures())
    assert front.upstream is None
    assert front.client is None
    async with front.connected():
        upstream = front.upstream
        assert isinstance(upstream, H11Upstream)
        assert front.client is not None
    assert front.upstream is None
    assert front.client is None


def test_every_series_is_in_docs_metrics_md() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    families = list(ServiceFigures().registry.collect())
    assert len(families) == 13
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}" in doc, f"{name} is not in docs/metrics.md"
