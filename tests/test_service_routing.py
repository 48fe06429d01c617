"""The service front's routing in process (agent/service/front.py, cellslots.py, figures.py): the
cells' front doors on an ``httpx.MockTransport`` (one ``Upstream`` of tests/kit/front.py per
cell, by host), requests through the ASGI app with no socket, on trio's autojump clock.

Which cell takes a request (a ready one with a free decode, the least loaded), how many at once
(its decodes), the one FIFO queue when none is free and its bounds, a cell leaving the table (its
streams run on, new requests go elsewhere), a cell cut (its streams end marked, its requests
before their first byte go elsewhere), a try failing before its first byte moved to another cell,
and the figures. The same with real jobs as cells: tests/test_service_front.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from agent.front.openai import CHAT
from agent.front.sse import DONE
from agent.front.upstream import H11Upstream
from agent.job.frontpolicy import FrontPolicy, FrontQueue, FrontRetry
from agent.service.figures import ServiceFigures
from agent.service.front import ServiceFront
from agent.service.records import CellRecord, CellState
from tests.kit.front import (
    ROLE,
    Answer,
    Client,
    Reply,
    Upstream,
    call,
    chat_body,
    chunk,
    events,
    refused,
    whole,
)
from tests.kit.metrics import samples
from tests.kit.waiting import until

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0}]}
MODELS = {"object": "list", "data": [{"id": "demo-model", "object": "model"}]}


def url(name: str) -> str:
    """Cell ``name``'s front door (its host is its name)."""
    return f"http://{name}:8080"


class GatedStream(httpx.AsyncByteStream):
    """A cell's streamed reply: its role and first token (unless ``early``: nothing before the
    gate), then it waits for ``gate``, then its end."""

    def __init__(self, gate: trio.Event, early: bool) -> None:
        self.gate = gate
        self.early = early

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if not self.early:
            yield ROLE
            yield chunk("Hello")
        await self.gate.wait()
        if self.early:
            yield ROLE
            yield chunk("Hello")
        yield chunk(" world")
        yield chunk(None, "stop")
        yield DONE


def gated(gate: trio.Event, *, early: bool = False) -> Answer:
    """A stream that waits for ``gate`` after its first token (``early``: before its first)."""

    async def answer(_request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=GatedStream(gate, early))

    return answer


class ServiceKit:
    """A ``ServiceFront`` whose cells are in process: ``cell`` adds one to the table."""

    def __init__(self, *, max_waiting: int = 1024, max_wait_s: float = 300.0) -> None:
        policy = FrontPolicy(
            retry=FrontRetry(attempts=5, budget_s=60.0),
            queue=FrontQueue(max_waiting=max_waiting, max_wait_s=max_wait_s),
        )
        self.doors: dict[str, Upstream] = {}
        self.records: dict[str, CellRecord] = {}
        self.figures = ServiceFigures()
        client = httpx.AsyncClient(transport=httpx.MockTransport(self._handle))
        self.front = ServiceFront(policy, self.figures, client)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        return await self.doors[request.url.host].handle(request)

    def cell(
        self, name: str, decodes: int = 1, state: CellState = "ready", served: int = 0
    ) -> Upstream:
        """Cell ``name`` in the table (its front door answers as scripted)."""
        door = self.doors.setdefault(name, Upstream())
        record = CellRecord(
            name=name, state=state, front_url=url(name), decodes=decodes, served=served
        )
        self.records[name] = record
        self.table()
        return door

    def table(self, *names: str) -> None:
        """The table handed to the front: ``names`` (all cells when none given)."""
        listed = names or tuple(self.records)
        self.front.set_cells([self.records[n] for n in listed])

    async def chat(self, tag: str = "", *, stream: bool = True) -> Reply:
        """One chat at the service front (``tag``: its ``user``, to tell requests apart)."""
        body = chat_body(stream=stream, user=tag)
        return await call(self.front.app, "POST", CHAT, Client((body,)))

    async def get(self, path: str) -> Reply:
        """A GET at the service front."""
        return await call(self.front.app, "GET", path, Client())

    def outcomes(self) -> dict[str, int]:
        """Requests by outcome so far (those counted)."""
        return {k: v for k, v in self.front.requests().items() if v}

    def at(self, name: str) -> list[str]:
        """The tags of the requests cell ``name`` was sent, in order."""
        return [json.loads(r.content)["user"] for r in self.doors[name].seen]


async def start(kit: ServiceKit, nursery: trio.Nursery, tag: str, got: dict[str, Reply]) -> None:
    """A streamed chat started (its reply into ``got[tag]`` once it ended)."""

    async def run() -> None:
        got[tag] = await kit.chat(tag)

    nursery.start_soon(run)
    await trio.testing.wait_all_tasks_blocked()


def text(reply: Reply) -> str:
    """A streamed reply's text (every content delta)."""
    out = ""
    for event in reply.events():
        data = event[len(b"data: ") :].strip()
        if data != b"[DONE]":
            for choice in json.loads(data).get("choices") or []:
                out += (choice.get("delta") or {}).get("content") or ""
    return out


def last_error(reply: Reply) -> dict[str, Any]:
    """The error event of a streamed reply (its second-to-last, before [DONE])."""
    events = reply.events()
    assert events[-1] == DONE, events
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert isinstance(error, dict)
    return error


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


# ---- a cell leaving, a cell cut, a try moved ---------------------------------------------------


async def test_a_cell_leaving_the_table_finishes_its_streams_and_takes_no_new_one(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    gate = trio.Event()
    kit.cell("cell-1", 1).script(gated(gate))
    kit.cell("cell-2", 1).script(gated(gate))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "r1", got)
        assert kit.at("cell-1") == ["r1"]
        kit.table("cell-2")  # cell-1 retired: its stream runs on
        assert kit.front.in_flight("cell-1") == 1
        assert kit.front.slots.routable() == ["cell-2"]
        await start(kit, nursery, "r2", got)  # cell-2's decode is free: at once
        assert kit.at("cell-2") == ["r2"]
        await start(kit, nursery, "r3", got)  # waits for cell-2's decode, not cell-1's
        assert kit.front.slots.admission.waiting == 1
        gate.set()
    assert kit.at("cell-1") == ["r1"]
    assert kit.at("cell-2") == ["r2", "r3"]
    assert {tag: text(reply) for tag, reply in got.items()} == dict.fromkeys(got, "Hello world")
    assert kit.outcomes() == {"ok": 3}
    assert kit.front.in_flight("cell-1") == 0
    assert kit.front.served("cell-1") == 1  # still known once it left
    page = samples(kit.figures.page().decode())
    gauges = {s.labels["cell"] for s in page if s.name == "tilert_service_cell_in_flight"}
    assert gauges == {"cell-2"}  # the gone cell's gauges went with it


async def test_a_cut_cell_ends_its_streams_marked_and_its_waiting_tries_move(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    never = trio.Event()  # cell-1 died: its streams never go on
    kit.cell("cell-1", 2).script(gated(never), gated(never, early=True))
    gate = trio.Event()
    kit.cell("cell-2", 2).script(gated(gate))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "streaming", got)  # cell-1, its first token passed
        await start(kit, nursery, "other", got)  # cell-2
        await start(kit, nursery, "not-begun", got)  # cell-1, no byte yet
        assert kit.at("cell-1") == ["streaming", "not-begun"]
        kit.front.cut("cell-1")
        await trio.testing.wait_all_tasks_blocked()
        assert "streaming" in got
        assert kit.at("cell-2") == ["other", "not-begun"]
        kit.table()  # a table still saying cell-1 is ready does not bring it back
        assert kit.front.slots.routable() == ["cell-2"]
        gate.set()
    assert text(got["streaming"]) == "Hello"
    error = last_error(got["streaming"])
    assert error["type"] == "stream_truncated"
    assert "cell-1 failed" in error["message"]
    assert text(got["other"]) == text(got["not-begun"]) == "Hello world"
    assert kit.outcomes() == {"ok": 1, "retried_ok": 1, "truncated": 1}
    assert kit.figures.tally[("truncated", "cell-1")] == 1
    assert kit.figures.tally[("retried_ok", "cell-2")] == 1
    assert kit.front.in_flight("cell-1") == 0


async def test_a_try_failing_before_its_first_byte_goes_to_another_cell(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    kit.cell("cell-1", 1).script(refused())  # its front door is gone
    kit.cell("cell-2", 1).script(whole(ANSWER))
    reply = await kit.chat("r1", stream=False)
    assert (reply.status, reply.json()) == (200, ANSWER)
    assert (kit.at("cell-1"), kit.at("cell-2")) == (["r1"], ["r1"])
    assert kit.outcomes() == {"retried_ok": 1}
    assert kit.figures.tally[("retried_ok", "cell-2")] == 1


async def test_the_last_cell_cut_before_the_first_byte_is_a_503(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    kit.cell("cell-1", 1).script(gated(trio.Event(), early=True))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "r1", got)
        kit.front.cut("cell-1")
    assert got["r1"].status == 503
    assert got["r1"].error()["type"] == "unavailable"
    assert kit.outcomes() == {"failed": 1}
    assert not kit.front.serving()


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
