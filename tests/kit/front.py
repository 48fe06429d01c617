"""The front door in process, for its plumbing tests (tests/test_front_plumbing.py).

The router is an ``httpx.MockTransport`` handed to ``Front`` (``Upstream``: its answers scripted
per request, what it was sent kept); the router's state is what the head would tell the front
(``ScriptedRouter``: none, handing over, serving, its pool settling), changed by a test or played
on trio's clock; requests go through the front's ASGI app with no socket (``FrontKit.call``),
a client that sends its body slowly or leaves mid-stream among them. On pytest-trio's
``autojump_clock`` the retries' pauses, a hand-over's wait and the budget's seconds take no real
time: nothing here starts a process, a thread or a socket.

The events are the real router's (tilert 0.1.6.post3), as tests/test_front.py sees them: a
decode that dies mid-stream ends with a ``stop`` chunk, ``data: {"error": ...}``, ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import trio

from agent.front import Front, FrontFigures, RouterNow
from agent.front.openai import CHAT
from agent.front.sse import DONE
from agent.job.frontpolicy import FrontPolicy, FrontQueue, FrontRetry

ROUTER_A = "http://router-a:8000"
ROUTER_B = "http://router-b:8001"
ROLE = b'data: {"id": "chatcmpl-1", "choices": [{"delta": {"role": "assistant"}}]}\n\n'
CUT = (
    b'data: {"error": {"error": "stream failed: peer closed", '
    b'"error_type": "decode_stream_failed"}}\n\n'
)
USAGE = b'data: {"id": "chatcmpl-1", "choices": [], "usage": {"completion_tokens": 2}}\n\n'
WAIT_S = 3600.0  # a test's own bound on trio's clock: never reached unless the front hangs
STOP_S = 5.0  # when a client with ``stopped_at_start`` has the app cancelled (trio's clock)


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    """One chat.completion.chunk event as the router sends it."""
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [choice],
    }
    return f"data: {json.dumps(body)}\n\n".encode()


def full_reply(*texts: str) -> list[bytes]:
    """A whole streamed reply: the role, ``texts``, the ``stop`` and ``[DONE]``."""
    return [ROLE, *(chunk(t) for t in texts), chunk(None, "stop"), DONE]


# ---- the router's state --------------------------------------------------------------------


class ScriptedRouter:
    """The router as the head tells the front (``RouterNow``); each change wakes the front, as
    the head's changes do."""

    def __init__(self) -> None:
        self.state = RouterNow(None, False, "no router in this test yet")
        self.front: Front | None = None
        self.failure: Exception | None = None  # raised when asked: a bug behind the front

    def now(self) -> RouterNow:
        """What ``Front`` asks at every request and try."""
        if self.failure is not None:
            raise self.failure
        return self.state

    def set(self, state: RouterNow) -> None:
        """The head saw ``state``: the front's waiting requests look again."""
        self.state = state
        if self.front is not None:
            self.front.changed()

    def none(self, why: str = "no router serves this job yet (or any more)") -> None:
        """No router (before it starts, after the job ended)."""
        self.set(RouterNow(None, False, why))

    def handing_over(self, url: str = ROUTER_A) -> None:
        """A router at ``url`` (re)starting: a hand-over, or a crash the head restarts."""
        self.set(RouterNow(url, False, "the router is starting: handed over"))

    def serving(self, url: str = ROUTER_A, *, settling: str | None = None) -> None:
        """The router at ``url`` serves (``settling``: why its pool is not whole)."""
        self.set(RouterNow(url, True, "the router is healthy", settling))

    async def play(self, steps: Iterable[tuple[float, Callable[[], None]]]) -> None:
        """Each step at its time on trio's clock, counted from now."""
        start = trio.current_time()
        for at, step in steps:
            await trio.sleep_until(start + at)
            step()


# ---- the router's answers ------------------------------------------------------------------

Answer = Callable[[httpx.Request], Awaitable[httpx.Response]]
Then = Literal["end", "hang", "break"]


class RouterStream(httpx.AsyncByteStream):
    """A streamed reply of the router: its events one read each, then the end, a hang (a decode
    still working) or a broken connection; ``closed`` once the front closed it."""

    def __init__(self, events: Sequence[bytes], then: Then) -> None:
        self.events = events
        self.then = then
        self.closed = False
        self._sent: AsyncGenerator[bytes] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._sent = self._send()
        return self._sent

    async def _send(self) -> AsyncGenerator[bytes]:
        for event in self.events:
            yield event
            await trio.sleep(0.01)
        if self.then == "hang":
            await trio.sleep_forever()
        if self.then == "break":
            raise httpx.ReadError("peer closed connection without sending complete message body")

    async def aclose(self) -> None:
        self.closed = True
        if self._sent is not None:  # as a connection's stream is, when its reply is closed
            await self._sent.aclose()


def status(code: int, body: str = "", ctype: str = "text/plain") -> Answer:
    """The router answers ``code`` with ``body`` (on the wire: read as it arrives)."""

    async def answer(_request: httpx.Request) -> httpx.Response:
        stream = RouterStream([body.encode()], "end")
        return httpx.Response(code, headers={"content-type": ctype}, stream=stream)

    return answer


def whole(payload: dict[str, Any]) -> Answer:
    """The router's whole (not streamed) 200 reply."""
    return status(200, json.dumps(payload), "application/json")


def refused() -> Answer:
    """Nothing listens at the router's address."""

    async def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    return answer


def events(*sent: bytes, then: Then = "end") -> Answer:
    """The router's 200 stream of ``sent`` (see ``RouterStream``)."""

    async def answer(_request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=RouterStream(sent, then))

    return answer


class Upstream:
    """The router behind the front's transport: the n-th request gets the n-th answer (the
    last one again past the script's end)."""

    def __init__(self) -> None:
        self.answers: list[Answer] = [status(500, "no answer scripted")]
        self.seen: list[httpx.Request] = []
        self.streams: list[RouterStream] = []

    def script(self, *answers: Answer) -> None:
        """The answers to the next requests, in order."""
        self.answers = list(answers)
        self.seen.clear()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """``httpx.MockTransport``'s handler."""
        self.seen.append(request)
        response = await self.answers[min(len(self.seen), len(self.answers)) - 1](request)
        if isinstance(response.stream, RouterStream):
            self.streams.append(response.stream)
        return response


# ---- a client in process -------------------------------------------------------------------


@dataclass
class Reply:
    """What a client got from the front."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body, decoded."""
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of the reply, its shape checked: ``{"error": {"message":
        str, "type": str, "code": status, ...}}``."""
        body = self.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert isinstance(error["message"], str), error
        assert isinstance(error["type"], str), error
        assert error.get("code") == self.status, error
        return dict(error)

    def events(self) -> list[bytes]:
        """A streamed reply's events (each with its blank line)."""
        return [e + b"\n\n" for e in self.body.split(b"\n\n") if e]


@dataclass
class Client:
    """How the client behaves: its body in ``parts`` (then stalls, with ``stall``), and leaves
    once ``leave_after`` parts of the reply arrived."""

    parts: Sequence[bytes] = (b"",)
    stall: bool = False
    leave_after: int | None = None
    # Leaves once a part of the reply holding these bytes arrived (b"[DONE]": a client that
    # closes the moment it read the stream's end, before the response's own end).
    leave_on: bytes | None = None
    # The server stops (cancels the app) while the reply's start is being sent, before any chunk.
    stopped_at_start: bool = False
    # Leaves once this is set (the test's moment), as well as by the rules above.
    leave: trio.Event | None = None


async def call(
    app: Any, method: str, path: str, client: Client, headers: Sequence[tuple[bytes, bytes]] = ()
) -> Reply:
    """One request through the ASGI app (``agent.web.asgi``), as hypercorn would pass it."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b""}
    scope["headers"] = [(b"host", b"front"), *headers]
    body_parts = list(client.parts)
    left = client.leave if client.leave is not None else trio.Event()
    start: dict[str, Any] = {}
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if body_parts:
            part = body_parts.pop(0)
            more = bool(body_parts) or client.stall
            return {"type": "http.request", "body": part, "more_body": more}
        if client.stall:
            await trio.sleep_forever()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            if client.stopped_at_start:
                await trio.sleep_forever()  # cancelled by the stop, below
            return
        if message.get("body"):
            parts.append(message["body"])
        if client.leave_after is not None and len(parts) >= client.leave_after:
            left.set()
        if client.leave_on is not None and client.leave_on in message.get("body", b""):
            left.set()

    if client.stopped_at_start:
        with trio.move_on_after(STOP_S):
            await app(scope, receive, send)
    else:
        with trio.fail_after(WAIT_S):
            await app(scope, receive, send)
    headers_ = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return Reply(start["status"], headers_, b"".join(parts))


def chat_body(*, stream: bool = False, **extra: Any) -> bytes:
    """A chat request's body."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}
    return json.dumps(body | extra).encode()


class FrontKit:
    """A ``Front`` with its router in process: ``connected()`` opens its client to it."""

    def __init__(
        self,
        *,
        capacity: int = 4,
        attempts: int = 5,
        budget_s: float = 60.0,
        max_waiting: int = 1024,
        max_body_bytes: int = 1 << 20,
        body_timeout_s: float = 30.0,
        resume: bool = True,
    ) -> None:
        policy = FrontPolicy(
            retry=FrontRetry(attempts=attempts, budget_s=budget_s),
            queue=FrontQueue(max_waiting=max_waiting),
            max_body_bytes=max_body_bytes,
            body_timeout_s=body_timeout_s,
            resume=resume,
        )
        self.router = ScriptedRouter()
        self.upstream = Upstream()
        self.capacity = capacity
        self.figures = FrontFigures(None, {"agent": "prefill-0"})
        self.front = Front(
            model="m",
            policy=policy,
            router=self.router.now,
            figures=self.figures,
            capacity=lambda: self.capacity,
            transport=httpx.MockTransport(self.upstream.handle),
        )
        self.router.front = self.front

    async def call(
        self,
        method: str,
        path: str,
        client: Client | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply:
        """One request at the front."""
        return await call(self.front.app, method, path, client or Client(), headers)

    async def chat(
        self, *, stream: bool = False, leave_after: int | None = None, **extra: Any
    ) -> Reply:
        """One chat request at the front."""
        client = Client((chat_body(stream=stream, **extra),), leave_after=leave_after)
        return await self.call("POST", CHAT, client)

    def outcomes(self) -> dict[str, int]:
        """The requests' outcomes counted so far."""
        return {k: v for k, v in self.figures.tally.items() if v}
