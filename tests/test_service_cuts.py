"""The service front's cuts in process (agent/front/relay.py as agent/service/front.py runs it,
agent/service/cellslots.py), with the cells of tests/kit/servicecells.py on trio's autojump
clock: a cell leaving the table (its streams run on, new requests go elsewhere); a cell cut (its
streams continued at another cell as one stream, counted ``resumed``; marked ``stream_truncated``
where they cannot be: ``agent.front.resume`` off, tools, logprobs, no other cell; its requests
before their first byte go elsewhere); a cell's stream broken mid-way continued at another; a try
failing before its first byte moved to another cell; a client leaving counted ``cancelled`` once.
The same with real jobs as cells: tests/test_service_front.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from agent.front.sse import DONE
from tests.kit.front import ROLE, Reply, chunk, events, refused, whole
from tests.kit.metrics import samples
from tests.kit.servicecells import (
    ANSWER,
    ServiceKit,
    continued,
    gated,
    last_error,
    start,
    tag_of,
    text,
)
from tests.kit.waiting import until

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


REST = [ROLE, chunk(" world"), chunk(None, "stop"), DONE]  # a continuation, from its cell
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def second_id(event: bytes) -> bytes:
    """``event`` as another stream's (its own id)."""
    return event.replace(b'"chatcmpl-1"', b'"chatcmpl-2"')


def one_stream(reply: Reply) -> None:
    """``reply`` is one whole stream: one id, one role chunk, no error, a stop, [DONE]."""
    chunks = [json.loads(e[len(b"data: ") :]) for e in reply.events() if e != DONE]
    assert reply.events()[-1] == DONE
    assert {c.get("id") for c in chunks} == {"chatcmpl-1"}
    assert not any("error" in c for c in chunks)
    roles = [c for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
    assert len(roles) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_cut_cell_continues_its_streams_at_another_and_its_waiting_tries_move(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    never = trio.Event()  # cell-1 died: its streams never go on
    kit.cell("cell-1", 2).script(gated(never), gated(never, early=True))
    gate = trio.Event()
    rest = events(*(second_id(e) for e in REST))
    kit.cell("cell-2", 2).script(continued(rest, gated(gate)))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "streaming", got)  # cell-1, its first token passed
        await start(kit, nursery, "other", got)  # cell-2
        await start(kit, nursery, "not-begun", got)  # cell-1, no byte yet
        assert kit.at("cell-1") == ["streaming", "not-begun"]
        kit.front.cut("cell-1")
        await until(lambda: "streaming" in got, "the stream continued at cell-2 to its end")
        assert sorted(kit.at("cell-2")) == ["not-begun", "other", "streaming+"]
        kit.table()  # a table still saying cell-1 is ready does not bring it back
        assert kit.front.slots.routable() == ["cell-2"]
        gate.set()
    assert {tag: text(reply) for tag, reply in got.items()} == dict.fromkeys(got, "Hello world")
    one_stream(got["streaming"])
    bodies = [json.loads(r.content) for r in kit.doors["cell-2"].seen]
    sent = next(b for b in bodies if tag_of(b) == "streaming+")
    assert sent["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert kit.outcomes() == {"ok": 1, "retried_ok": 1, "resumed": 1}
    assert kit.figures.tally[("resumed", "cell-2")] == 1
    assert kit.figures.tally[("retried_ok", "cell-2")] == 1
    assert kit.front.in_flight("cell-1") == kit.front.in_flight("cell-2") == 0
    assert kit.front.served("cell-2") == 3


async def test_a_cells_stream_broken_mid_way_is_continued_at_another(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    kit.cell("cell-1", 1).script(events(ROLE, chunk("Hello"), then="break"))
    kit.cell("cell-2", 1).script(continued(events(*REST), whole(ANSWER)))
    reply = await kit.chat("r1")
    assert text(reply) == "Hello world"
    one_stream(reply)
    assert (kit.at("cell-1"), kit.at("cell-2")) == (["r1"], ["r1+"])
    assert kit.outcomes() == {"resumed": 1}
    assert kit.figures.tally[("resumed", "cell-2")] == 1


@pytest.mark.parametrize(
    ("resume", "extra", "cells"),
    [
        (False, {}, ("cell-1", "cell-2")),  # agent.front.resume: false
        (True, {"tools": TOOLS}, ("cell-1", "cell-2")),  # what cannot be continued
        (True, {"logprobs": True}, ("cell-1", "cell-2")),
        (True, {}, ("cell-1",)),  # no other cell to continue at
    ],
    ids=["resume-off", "tools", "logprobs", "no-other-cell"],
)
async def test_a_cut_that_cannot_be_continued_is_marked(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    resume: bool,
    extra: dict[str, Any],
    cells: tuple[str, ...],
) -> None:
    kit = ServiceKit(resume=resume)
    kit.cell("cell-1", 1).script(gated(trio.Event()))
    kit.cell("cell-2", 1).script(continued(events(*REST), whole(ANSWER)))
    kit.table(*cells)
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "r1", got, **extra)
        kit.front.cut("cell-1")
    assert text(got["r1"]) == "Hello"
    error = last_error(got["r1"])
    assert error["type"] == "stream_truncated"
    assert "cell-1 failed" in error["message"]
    assert kit.at("cell-2") == []
    assert kit.outcomes() == {"truncated": 1}
    assert kit.figures.tally[("truncated", "cell-1")] == 1
    assert kit.front.in_flight("cell-1") == 0


async def test_a_cut_cell_without_resume_ends_its_streams_marked_and_its_waiting_tries_move(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit(resume=False)
    never = trio.Event()  # cell-1 died: its streams never go on
    kit.cell("cell-1", 2).script(gated(never), gated(never, early=True))
    gate = trio.Event()
    kit.cell("cell-2", 2).script(gated(gate))
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "streaming", got)  # cell-1, its first token passed
        await start(kit, nursery, "other", got)  # cell-2
        await start(kit, nursery, "not-begun", got)  # cell-1, no byte yet
        kit.front.cut("cell-1")
        await trio.testing.wait_all_tasks_blocked()
        assert "streaming" in got
        assert kit.at("cell-2") == ["other", "not-begun"]
        gate.set()
    assert text(got["streaming"]) == "Hello"
    assert last_error(got["streaming"])["type"] == "stream_truncated"
    assert text(got["other"]) == text(got["not-begun"]) == "Hello world"
    assert kit.outcomes() == {"ok": 1, "retried_ok": 1, "truncated": 1}


async def test_a_client_leaving_mid_stream_is_cancelled_once_a_whole_stream_never(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = ServiceKit()
    never = trio.Event()
    kit.cell("cell-1", 3).script(
        gated(never), gated(never), events(*REST[:1], chunk("Hi"), *REST[2:])
    )
    kit.cell("cell-2", 1).script(continued(gated(never, early=True), whole(ANSWER)))
    kit.table("cell-1")
    leave = trio.Event()
    got: dict[str, Reply] = {}
    async with trio.open_nursery() as nursery:
        await start(kit, nursery, "leaves", got, leave_after=1)  # after its first token
        await start(kit, nursery, "continuing", got, leave=leave)
        got["whole"] = await kit.chat("whole")
        assert "leaves" in got
        kit.table("cell-1", "cell-2")
        kit.front.cut("cell-1")  # "continuing" is continued at cell-2, whose first byte waits
        await trio.testing.wait_all_tasks_blocked()
        assert kit.at("cell-2") == ["continuing+"]
        leave.set()  # its client leaves while its cut is being continued: it saw no cut
    assert text(got["whole"]) == "Hi"
    assert text(got["leaves"]) == text(got["continuing"]) == "Hello"
    assert kit.outcomes() == {"cancelled": 2, "ok": 1}
    assert kit.figures.tally[("cancelled", "cell-1")] == 1
    assert kit.figures.tally[("cancelled", "cell-2")] == 1
    assert kit.front.in_flight("cell-1") == kit.front.in_flight("cell-2") == 0


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
