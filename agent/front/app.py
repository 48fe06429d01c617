"""The front door: the job's one OpenAI-compatible address, in front of the router.

Served by the head agent from its start (before the router) on ``agent.front.port``, fixed for the
job's life. ``GET /v1/models`` and the refusals of what TileRT 0.1.6 cannot serve are answered
here; chats and completions go to the router through ``agent.front.proxy`` (tries, waits for a
hand-over), no more at a time than the router has decodes (``agent.front.admission``: the
others wait in the front's queue, in arrival order); a streamed reply is passed on event by
event through ``agent.front.sse``. Before a router serves, and after the job ended, every request
gets 503 with Retry-After; past the queue's bounds, 429 with Retry-After.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import trio

from agent.front.admission import Admission, QueueRefused
from agent.front.answers import (
    RETRY_AFTER_S,
    error,
    queue_refusal,
    refused,
    servable,
    toolkit_refusal,
)
from agent.front.figures import FrontFigures
from agent.front.openai import CHAT, COMPLETIONS, NO_ENGINE, models_body, wants_usage
from agent.front.proxy import (
    Proxy,
    Refused,
    RouterNow,
    StreamStart,
    Unavailable,
    make_upstream,
    relayed,
)
from agent.front.resume import Resume, why_not
from agent.front.retry import RetryBudget
from agent.front.ticket import Ticket
from agent.front.upstream import Reply
from agent.job.frontpolicy import FrontPolicy
from agent.web.asgi import App, Request, Response, StreamingResponse, json_response
from agent.web.h11server import serve

SSE = "text/event-stream; charset=utf-8"

log = logging.getLogger(__name__)


class Front:
    """The front door of one job: its app, its client to the router, its figures."""

    def __init__(
        self,
        *,
        model: str,
        policy: FrontPolicy,
        router: Callable[[], RouterNow],
        figures: FrontFigures,
        capacity: Callable[[], int],
        log: logging.Logger = log,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.figures = figures
        self.log = log
        self.created = int(time.time())
        self.budget = RetryBudget(policy.retry.attempts, policy.retry.budget_s)
        self.router = router
        self.transport = transport  # None: the router over the network (tests: in process)
        self.proxy: Proxy | None = None
        # Slots for the router's decodes (``capacity``: how many are in its list now).
        queue = policy.queue
        self.admission = Admission(
            capacity, max_waiting=queue.max_waiting, max_wait_s=queue.max_wait_s, watcher=figures
        )
        self.app = self._build()

    def changed(self) -> None:
        """The head saw a change: requests waiting for the router look again, and the queue
        lets in whom a grown pool allows."""
        self.admission.changed()
        if self.proxy is not None:
            self.proxy.changed()

    def _build(self) -> App:
        app = App(errors=toolkit_refusal)
        app.route("GET", "/v1/models")(self._models)
        app.route("GET", "/health")(self._health)
        for path in (CHAT, COMPLETIONS):
            app.route("POST", path)(self._generate)
        for path in NO_ENGINE:
            app.route("POST", path)(self._no_engine)
        return app

    async def run(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve on ``sock`` until cancelled."""
        async with self.connected():
            await serve(self.app, sock, task_status=task_status)

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        """The front's client to the router open: ``app`` sends requests on within it."""
        upstream = make_upstream(self.transport)
        try:
            self.proxy = Proxy(upstream, self.router, self.budget)
            yield
        finally:
            with trio.CancelScope(shield=True):
                await upstream.aclose()

    async def _models(self, _request: Request) -> Response:
        return json_response(models_body(self.model, self.created))

    async def _health(self, _request: Request) -> Response:
        now = self.router()
        if now.url is None or not now.serving:
            why = now.why or "no router serves yet"
            return error(503, why, "unavailable", **{"retry-after": str(RETRY_AFTER_S)})
        return json_response({"status": "ok", "router": now.url})

    async def _no_engine(self, request: Request) -> Response:
        return Ticket(self.figures).answer(
            error(404, NO_ENGINE[request.path], "unsupported"), "rejected"
        )

    async def _generate(self, request: Request) -> Response | StreamingResponse:
        ticket = Ticket(self.figures)
        try:
            return await self._answer(request, ticket)
        except BaseException:  # the client left (a stream's relay ends its own ticket)
            ticket.end("cancelled")
            raise

    async def _answer(self, request: Request, ticket: Ticket) -> Response | StreamingResponse:
        checked = await servable(request, self.policy)
        if isinstance(checked, Response):
            return ticket.answer(checked, "rejected")
        body, value = checked
        if self.proxy is None:  # not serving yet: run() makes it before the socket serves
            return ticket.answer(error(503, "the front is starting", "unavailable"), "rejected")
        now = self.router()
        if now.url is None:  # no router yet, or the job ended: no queue to wait in
            why = now.why or "no router serves this job yet"
            retry = {"retry-after": str(RETRY_AFTER_S)}
            return ticket.answer(error(503, why, "unavailable", **retry), "rejected")
        try:
            slot = await self.admission.enter()
        except QueueRefused as exc:
            return ticket.answer(queue_refusal(exc), "rejected")
        ticket.hold(slot)  # given back when the ticket ends: a stream's when its relay ends
        return await self._send(self.proxy, request.path, body, value, ticket)

    async def _send(
        self, proxy: Proxy, path: str, body: bytes, value: dict[str, Any], ticket: Ticket
    ) -> Response | StreamingResponse:
        """The request at the router, within its slot."""
        stream = bool(value.get("stream"))
        resume = self._resume(proxy, path, value, ticket)
        try:
            result = await proxy.send(
                path,
                body,
                stream=stream,
                on_retry=ticket.retried,
                want_usage=wants_usage(value),
                new_watch=None if resume is None else resume.first_watch,
            )
        except Unavailable as exc:
            retry = {"retry-after": str(RETRY_AFTER_S)}
            return ticket.answer(error(503, str(exc), "unavailable", **retry), "rejected")
        if isinstance(result, Refused):
            return ticket.answer(*refused(result))
        if result.stream is None:
            ctype = result.response.content_type
            return ticket.answer(Response(result.body, 200, ctype), ticket.served())
        chunks = self._relay(result.response, result.stream, ticket, resume)
        upstream = result.response

        async def closed() -> None:
            # The relay's own ``finally`` ends the ticket; this covers a relay that never ran
            # (the response cancelled before its first chunk): the router's stream closed, the
            # slot given back. Both are no-ops after the relay's end.
            await upstream.aclose()
            ticket.end("cancelled")

        return StreamingResponse(chunks, 200, SSE, {"cache-control": "no-cache"}, closed)

    def _resume(
        self, proxy: Proxy, path: str, value: dict[str, Any], ticket: Ticket
    ) -> Resume | None:
        """The request's continuations after a cut, when ``agent.front.resume`` and the request
        allow them (``agent.front.resume``)."""
        if not self.policy.resume or why_not(path, value) is not None:
            return None
        return Resume(proxy, path, value, wants_usage(value), ticket.retried, self.log)

    async def _relay(
        self, response: Reply, start: StreamStart, ticket: Ticket, resume: Resume | None
    ) -> AsyncIterator[bytes]:
        """The stream passed on as it arrives (a cut continued by ``resume``); its ticket ended
        when it ends (its slot given back once the router's reply ended: the router has freed
        its decode by then)."""
        watch = start.reader.watch
        finished = False
        try:
            ticket.first_byte()
            async with aclosing(relayed(response, start, self.log)) as events:
                async for out in events:
                    yield out
            if watch.truncated and resume is not None:
                self.log.warning("front: a stream was cut, continuing it: %s", watch.truncated)
                async with aclosing(resume.rest(watch)) as events:
                    async for out in events:
                        yield out
                watch = resume.last or watch
            finished = True
            if watch.truncated:
                self.log.warning("front: a stream was cut: %s", watch.truncated)
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()
            # A cut counts as truncated even when the client left on its error event.
            last = watch if resume is None or resume.last is None else resume.last
            if last.truncated:
                ticket.end("truncated")
            elif not finished:
                ticket.end("cancelled")
            else:
                ticket.end("resumed" if resume is not None and resume.count else ticket.served())
