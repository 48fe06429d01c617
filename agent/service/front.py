"""The service front: one OpenAI-compatible address before the service's cells (docs/service.md).

Each chat or completion (streamed or not) takes a slot at a ``ready`` cell with a free decode, or
waits for one in the front's one FIFO queue (``agent.service.cellslots``), and is sent to that
cell's front door (``CellRecord.front_url``), which has its own admission, retries and hand-overs.
The request is sent and its reply passed on by the front door's relay (``agent.front.relay``),
its cell (``agent.service.cellslots.Route``) the relay's way: a try that fails before the
client's first byte goes to another cell (the front door's rules, ``agent.front.retry``), as
does a request whose cell is ``cut`` (its job failed) before its first byte; a stream is passed
on event by event, and one cut by its cell's failure (or broken mid-way) is continued at another
cell (``agent.front.resume``, counted ``resumed``) or, where it cannot be, ends with the visible
``stream_truncated`` error event. Everything the front answers itself is the front door's
(``agent.front.answers``, ``agent.front.openai``), counted once per request by a
``agent.front.ticket.Ticket``. ``/v1/models`` is a ready cell's answer, ``/health`` is 200 while
a cell takes requests (503 otherwise), ``/metrics`` is ``agent.service.figures``'.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from agent.front.admission import QueueRefused
from agent.front.answers import (
    error,
    queue_refusal,
    servable,
    toolkit_refusal,
    unavailable,
)
from agent.front.figures import OUTCOMES, Outcome
from agent.front.openai import CHAT, COMPLETIONS, NO_ENGINE
from agent.front.proxy import Proxy, make_client, make_upstream
from agent.front.relay import Relay
from agent.front.retry import RetryBudget
from agent.front.ticket import Ticket
from agent.front.upstream import HttpxUpstream, Upstream
from agent.job.frontpolicy import FrontPolicy
from agent.service.cellslots import CellSlots, Route
from agent.service.figures import CELL_CUT, CONTENT_TYPE, NO_CELL, ServiceFigures
from agent.service.records import CellRecord, CellState
from agent.web.asgi import App, Request, Response, StreamingResponse, json_response
from agent.web.h11server import serve

MODELS_TIMEOUT_S = 5.0
# Cells that may serve soon: a request that finds none serving waits for them in the queue.
COMING: frozenset[CellState] = frozenset({"submitted", "starting", "ready"})
SERVED: frozenset[Outcome] = frozenset({"ok", "retried_ok", "resumed"})

log = logging.getLogger(__name__)


class _Counted:
    """A request's figures (``agent.front.ticket.Counted``), counted at the cell it ended at."""

    def __init__(self, figures: ServiceFigures) -> None:
        self.figures = figures
        self.route: Route | None = None

    def started(self) -> None:
        self.figures.started()

    def retried(self, reason: str) -> None:
        self.figures.retried(reason)

    def first_byte(self, ttfb_s: float) -> None:
        self.figures.first_byte(ttfb_s)

    def ended(self, outcome: Outcome, latency_s: float) -> None:
        route = self.route
        cell = route.cell_name if route is not None else None
        self.figures.ended(outcome, cell or NO_CELL, latency_s)
        if route is not None and outcome in SERVED:
            route.count_served()


class ServiceFront:
    """The service front: its app, its routing across cells, its client to their front doors
    (``client``: a test's, its transport the cells in process; None: the front door's own h11
    upstream to them, and an httpx client for their ``/v1/models``, open while ``run()`` runs)."""

    def __init__(
        self,
        policy: FrontPolicy,
        figures: ServiceFigures,
        client: httpx.AsyncClient | None = None,
        *,
        log: logging.Logger = log,
    ) -> None:
        self.policy = policy
        self.figures = figures
        self.log = log
        self.budget = RetryBudget(policy.retry.attempts, policy.retry.budget_s)
        queue = policy.queue
        self.slots = CellSlots(
            max_waiting=queue.max_waiting, max_wait_s=queue.max_wait_s, watcher=figures
        )
        self._coming = False
        self._given = client  # the caller's (it closes it); None: our own, open while run()s
        self.client: httpx.AsyncClient | None = client  # the cells' /v1/models
        # The requests to the cells: the front door's upstream (``make_upstream``), or the test's.
        self.upstream: Upstream | None = None if client is None else HttpxUpstream(client)
        self._carried: dict[str, int] = {}
        self.app = self._build()

    # ---- the control plane's API -------------------------------------------------------------

    def set_cells(self, cells: Sequence[CellRecord]) -> None:
        """The whole table of cells, on every change: new requests go only to cells ``ready``
        with a ``front_url`` and ready decodes; a cell that left that set gets none, and its
        requests run on."""
        self.slots.set_cells(cells)
        # A request that finds no cell serving waits in the queue (bounded by max_wait_s) while
        # one may come: a cell loading, or a ready one whose decodes dropped out for a moment.
        self._coming = any(c.state in COMING for c in cells)

    def cut(self, name: str) -> None:
        """Cell ``name`` failed: its streams end now, marked ``stream_truncated``; its requests
        that had no byte yet go to another cell; it gets no request again."""
        self.log.warning("service front: cell %s cut (%d in flight)", name, self.in_flight(name))
        self.slots.cut(name)

    def in_flight(self, name: str) -> int:
        """This front's requests at cell ``name`` now."""
        return self.slots.in_flight(name)

    def served(self, name: str) -> int:
        """Requests cell ``name`` served (its ``CellRecord.served`` when first seen, plus ours)."""
        return self.slots.served(name)

    def requests(self) -> dict[str, int]:
        """Requests ended by outcome: since this front started, plus what ``carry`` carried."""
        out: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        for (outcome, _cell), count in self.figures.tally.items():
            out[outcome] += count
        for outcome, count in self._carried.items():
            out[outcome] = out.get(outcome, 0) + count
        return out

    def carry(self, requests: Mapping[str, int]) -> None:
        """The counts of a previous front of this service (``service.json``'s ``requests``),
        carried on by ``requests``."""
        for outcome, count in requests.items():
            self._carried[outcome] = self._carried.get(outcome, 0) + count

    def serving(self) -> bool:
        """Some cell takes requests."""
        return self.slots.serving()

    async def run(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve on ``sock`` (bound and listening: ``agent.web.server.bound_socket``, or one
        handed over by systemd) until cancelled."""
        async with self.connected():
            await serve(self.app, sock, task_status=task_status)

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        """The front's clients to the cells open: ``app`` sends requests on within it."""
        if self._given is not None:
            yield
            return
        upstream = make_upstream()
        try:
            async with make_client() as client:
                self.client, self.upstream = client, upstream
                try:
                    yield
                finally:
                    self.client = self.upstream = None
        finally:
            with trio.CancelScope(shield=True):
                await upstream.aclose()

    # ---- the app -----------------------------------------------------------------------------

    def _build(self) -> App:
        app = App(errors=toolkit_refusal)
        app.route("GET", "/v1/models")(self._models)
        app.route("GET", "/health")(self._health)
        app.route("GET", "/metrics")(self._metrics)
        for path in (CHAT, COMPLETIONS):
            app.route("POST", path)(self._generate)
        for path in NO_ENGINE:
            app.route("POST", path)(self._no_engine)
        return app

    async def _health(self, _request: Request) -> Response:
        if not self.serving():
            return unavailable("no cell of the service takes requests now")
        return json_response({"status": "ok", "cells": self.slots.routable()})

    async def _metrics(self, _request: Request) -> Response:
        return Response(self.figures.page(), 200, CONTENT_TYPE)

    async def _models(self, _request: Request) -> Response:
        """A ready cell's own ``/v1/models`` (every cell serves the one model)."""
        client = self.client
        if client is None:
            return unavailable("the service front is starting")
        for url in self.slots.urls():
            try:
                answer = await client.get(url + "/v1/models", timeout=MODELS_TIMEOUT_S)
            except httpx.HTTPError as exc:
                self.log.info("service front: %s/v1/models: %r", url, exc)
                continue
            if answer.status_code == 200:
                return Response(answer.content, 200, "application/json")
        return unavailable("no cell of the service takes requests now")

    async def _no_engine(self, request: Request) -> Response:
        ticket = Ticket(_Counted(self.figures))
        return ticket.answer(error(404, NO_ENGINE[request.path], "unsupported"), "rejected")

    async def _generate(self, request: Request) -> Response | StreamingResponse:
        counted = _Counted(self.figures)
        ticket = Ticket(counted)
        try:
            return await self._answer(request, ticket, counted)
        except BaseException:  # the client left (a stream's relay ends its own ticket)
            ticket.end("cancelled")
            raise

    async def _answer(
        self, request: Request, ticket: Ticket, counted: _Counted
    ) -> Response | StreamingResponse:
        checked = await servable(request, self.policy)
        if isinstance(checked, Response):
            return ticket.answer(checked, "rejected")
        body, value = checked
        if self.upstream is None:  # not serving yet: run() opens it before the socket serves
            return ticket.answer(unavailable("the service front is starting"), "rejected")
        if not self.serving() and not self._coming:
            return ticket.answer(unavailable("no cell of the service is ready yet"), "rejected")
        try:
            route = await self.slots.enter()
        except QueueRefused as exc:
            return ticket.answer(queue_refusal(exc), "rejected")
        counted.route = route
        ticket.hold(route)  # given back when the ticket ends: a stream's when its relay ends
        return await self._send(self.upstream, request.path, body, value, ticket, route)

    async def _send(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        value: dict[str, Any],
        ticket: Ticket,
        route: Route,
    ) -> Response | StreamingResponse:
        """The request at its cell's front door (another cell's after a failed try or a cut; a
        stream cut by its cell's failure continued at another when ``agent.front.resume`` and
        the request allow it)."""
        relay = Relay(
            Proxy(upstream, route.now, self.budget),
            ticket,
            way=route,
            resume=self.policy.resume,
            unavailable_outcome="failed",
            log=self.log,
            who="service front",
            cut_reason=CELL_CUT,
        )
        return await relay.answer(path, body, value)
