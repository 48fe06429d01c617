"""The front door: the job's one OpenAI-compatible address, in front of the router.

Served by the head agent from its start (before the router) on ``agent.front.port``, fixed for the
job's life. ``GET /v1/models`` and the refusals of what TileRT 0.1.6 cannot serve are answered
here; chats and completions go to the router through ``agent.front.relay`` (tries, waits for a
hand-over, a cut stream continued or marked), no more at a time than the router has decodes
(``agent.front.admission``: the others wait in the front's queue, in arrival order); a streamed
reply is passed on event by event through ``agent.front.sse``. Before a router serves, and after
the job ended, every request gets 503 with Retry-After; past the queue's bounds, 429 with
Retry-After.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from agent.front.admission import Admission, QueueRefused
from agent.front.answers import (
    RETRY_AFTER_S,
    error,
    queue_refusal,
    servable,
    toolkit_refusal,
)
from agent.front.figures import FrontFigures
from agent.front.openai import CHAT, COMPLETIONS, NO_ENGINE, models_body
from agent.front.proxy import Proxy, RouterNow, make_upstream
from agent.front.relay import Relay, ToRouter
from agent.front.retry import RetryBudget
from agent.front.ticket import Ticket
from agent.job.frontpolicy import FrontPolicy
from agent.web.asgi import App, Request, Response, StreamingResponse, json_response
from agent.web.h11server import serve

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
        """The request at the router, within its slot (a cut stream continued when
        ``agent.front.resume`` and the request allow it)."""
        relay = Relay(
            proxy,
            ticket,
            way=ToRouter(),
            resume=self.policy.resume,
            unavailable_outcome="rejected",
            log=self.log,
        )
        return await relay.answer(path, body, value)
