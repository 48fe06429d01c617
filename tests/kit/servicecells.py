"""The service front with its cells in process, for tests/test_service_routing.py and
tests/test_service_cuts.py: each cell's front door an ``Upstream`` of tests/kit/front.py (its
answers scripted, what it was sent kept) behind one ``httpx.MockTransport`` (by host, the cell's
name), requests through the front's ASGI app with no socket (``ServiceKit``); streams that wait
for the test's gate (``gated``), a front door that answers a continuation of a cut stream
otherwise (``continued``), and readers of what a client got.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
import trio.testing

from agent.front.openai import CHAT
from agent.front.sse import DONE
from agent.job.frontpolicy import FrontPolicy, FrontQueue, FrontRetry
from agent.service.figures import ServiceFigures
from agent.service.front import ServiceFront
from agent.service.records import CellRecord, CellState
from tests.kit.front import ROLE, Answer, Client, Reply, Upstream, call, chat_body, chunk

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

    def __init__(
        self, *, max_waiting: int = 1024, max_wait_s: float = 300.0, resume: bool = True
    ) -> None:
        policy = FrontPolicy(
            retry=FrontRetry(attempts=5, budget_s=60.0),
            queue=FrontQueue(max_waiting=max_waiting, max_wait_s=max_wait_s),
            resume=resume,
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

    async def chat(
        self,
        tag: str = "",
        *,
        stream: bool = True,
        leave_after: int | None = None,
        leave: trio.Event | None = None,
        **extra: Any,
    ) -> Reply:
        """One chat at the service front (``tag``: its ``user``, to tell requests apart; its
        client leaves once ``leave_after`` parts of the reply arrived, or once ``leave`` is
        set)."""
        body = chat_body(stream=stream, user=tag, **extra)
        client = Client((body,), leave_after=leave_after, leave=leave)
        return await call(self.front.app, "POST", CHAT, client)

    async def get(self, path: str) -> Reply:
        """A GET at the service front."""
        return await call(self.front.app, "GET", path, Client())

    def outcomes(self) -> dict[str, int]:
        """Requests by outcome so far (those counted)."""
        return {k: v for k, v in self.front.requests().items() if v}

    def at(self, name: str) -> list[str]:
        """The tags of the requests cell ``name`` was sent, in order (a continuation's tag with
        a ``+``)."""
        return [tag_of(json.loads(r.content)) for r in self.doors[name].seen]


def tag_of(body: dict[str, Any]) -> str:
    """A request's tag: its ``user``, and ``+`` when it continues a cut stream."""
    return str(body["user"]) + ("+" if body.get("continue_final_message") else "")


def continued(rest: Answer, first: Answer) -> Answer:
    """A cell's front door that answers a continuation with ``rest``, any other with ``first``."""

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return await (rest if body.get("continue_final_message") else first)(request)

    return answer


async def start(
    kit: ServiceKit, nursery: trio.Nursery, tag: str, got: dict[str, Reply], **extra: Any
) -> None:
    """A streamed chat started (its reply into ``got[tag]`` once it ended)."""

    async def run() -> None:
        got[tag] = await kit.chat(tag, **extra)

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
