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

from agent.errors import BadInput
from agent.front.admission import Admission, QueueRefused
from agent.front.figures import FrontFigures, Outcome
from agent.front.openai import (
    CHAT,
    COMPLETIONS,
    NO_ENGINE,
    error_body,
    models_body,
    unsupported,
    upstream_error,
    wants_usage,
)
from agent.front.proxy import Proxy, Refused, RouterNow, StreamStart, Unavailable, make_upstream
from agent.front.retry import RetryBudget
from agent.front.ticket import Ticket
from agent.front.upstream import Reply, UpstreamError
from agent.job.frontpolicy import FrontPolicy
from agent.web.asgi import (
    App,
    HTTPError,
    Request,
    Response,
    StreamingResponse,
    decode_json,
    json_response,
)
from agent.web.server import serve

RETRY_AFTER_S = 2
SSE = "text/event-stream; charset=utf-8"

log = logging.getLogger(__name__)


class BodyError(BadInput):
    """A request body the front refuses before it reaches the router (413, 408, 400): the
    client's to fix; answered, never an exit."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str, **headers: str) -> Response:
    response = json_response(error_body(message, kind, code=status), status)
    response.headers.update(headers)
    return response


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
        app = App(errors=_refusal)
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
            return _error(503, why, "unavailable", **{"retry-after": str(RETRY_AFTER_S)})
        return json_response({"status": "ok", "router": now.url})

    async def _no_engine(self, request: Request) -> Response:
        return Ticket(self.figures).answer(
            _error(404, NO_ENGINE[request.path], "unsupported"), "rejected"
        )

    async def _read_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        """The request's body within ``agent.front.max_body_bytes`` and ``body_timeout_s``."""
        limit = self.policy.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyError(413, _too_big(limit), "request_too_large")
        body = await _bounded_body(request, limit, self.policy.body_timeout_s)
        try:
            value = decode_json(body)
        except HTTPError as exc:
            raise BodyError(exc.status, exc.message, "invalid_request") from None
        if not isinstance(value, dict):
            raise BodyError(400, "the request body must be a JSON object", "invalid_request")
        return body, value

    async def _generate(self, request: Request) -> Response | StreamingResponse:
        ticket = Ticket(self.figures)
        try:
            return await self._answer(request, ticket)
        except BaseException:  # the client left (a stream's relay ends its own ticket)
            ticket.end("cancelled")
            raise

    async def _answer(self, request: Request, ticket: Ticket) -> Response | StreamingResponse:
        try:
            body, value = await self._read_json(request)
        except BodyError as exc:
            return ticket.answer(_error(exc.status, exc.message, exc.kind), "rejected")
        why = unsupported(request.path, value)
        if why is not None:
            return ticket.answer(_error(400, why, "unsupported"), "rejected")
        if self.proxy is None:  # not serving yet: run() makes it before the socket serves
            return ticket.answer(_error(503, "the front is starting", "unavailable"), "rejected")
        now = self.router()
        if now.url is None:  # no router yet, or the job ended: no queue to wait in
            why = now.why or "no router serves this job yet"
            retry = {"retry-after": str(RETRY_AFTER_S)}
            return ticket.answer(_error(503, why, "unavailable", **retry), "rejected")
        try:
            slot = await self.admission.enter()
        except QueueRefused as exc:
            return ticket.answer(_queue_refusal(exc), "rejected")
        ticket.hold(slot)  # given back when the ticket ends: a stream's when its relay ends
        return await self._send(self.proxy, request.path, body, value, ticket)

    async def _send(
        self, proxy: Proxy, path: str, body: bytes, value: dict[str, Any], ticket: Ticket
    ) -> Response | StreamingResponse:
        """The request at the router, within its slot."""
        stream = bool(value.get("stream"))
        try:
            result = await proxy.send(
                path, body, stream=stream, on_retry=ticket.retried, want_usage=wants_usage(value)
            )
        except Unavailable as exc:
            retry = {"retry-after": str(RETRY_AFTER_S)}
            return ticket.answer(_error(503, str(exc), "unavailable", **retry), "rejected")
        if isinstance(result, Refused):
            return ticket.answer(*_refused(result))
        if result.stream is None:
            ctype = result.response.content_type
            return ticket.answer(Response(result.body, 200, ctype), ticket.served())
        chunks = self._relay(result.response, result.stream, ticket)
        upstream = result.response

        async def closed() -> None:
            # The relay's own ``finally`` ends the ticket; this covers a relay that never ran
            # (the response cancelled before its first chunk): the router's stream closed, the
            # slot given back. Both are no-ops after the relay's end.
            await upstream.aclose()
            ticket.end("cancelled")

        return StreamingResponse(chunks, 200, SSE, {"cache-control": "no-cache"}, closed)

    async def _relay(
        self, response: Reply, start: StreamStart, ticket: Ticket
    ) -> AsyncIterator[bytes]:
        """The stream passed on as it arrives; its ticket ended when it ends (its slot given
        back once the router's reply ended: the router has freed its decode by then)."""
        reader, watch = start.reader, start.reader.watch
        finished = False
        try:
            ticket.first_byte()
            # Nothing waits for more than what has arrived (``StreamReader.read``).
            if start.first:
                yield b"".join(start.first)
            try:
                while (out := await reader.read()) is not None:
                    if out:
                        yield out
            except UpstreamError as exc:
                self.log.warning("front: the router's stream broke: %r", exc)
            if tail := reader.end():
                yield tail
            finished = True
            if watch.truncated:
                self.log.warning("front: a stream was cut: %s", watch.truncated)
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()
            # A cut counts as truncated even when the client left on its error event.
            if watch.truncated:
                ticket.end("truncated")
            else:
                ticket.end(ticket.served() if finished else "cancelled")


def _refused(refused: Refused) -> tuple[Response, Outcome]:
    """The router's last answer: its 4xx passed on (a 501 said as 400), a failure as 502/503."""
    failure = refused.failure
    status = failure.status
    if status is not None and 400 <= status < 500 and failure.reason != "busy":
        return json_response(upstream_error(status, refused.content), status), "rejected"
    if status == 501:
        body = upstream_error(400, refused.content)
        body["error"]["type"] = "unsupported"
        return json_response(body, 400), "rejected"
    message = f"the router could not serve the request in {refused.tries} tries: "
    answer = 503 if status in (None, 429, 503) else 502
    body = error_body(message + failure.message[:500], "upstream_failed", code=answer)
    response = json_response(body, answer)
    response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response, "failed"


def _refusal(status: int, message: str) -> Response:
    """What the toolkit answers itself (no route, a header that is not UTF-8, a handler that
    failed), in OpenAI's error shape like every other answer of the front."""
    kinds = {404: "not_found", 405: "method_not_allowed", 500: "server_error"}
    kind = kinds.get(status, "invalid_request")
    return _error(status, message, kind)


def _queue_refusal(exc: QueueRefused) -> Response:
    """429 past the queue's bound (503 when no decode was in the pool at all), in OpenAI's
    shape, with its reason and Retry-After."""
    kind = "rate_limit_exceeded" if exc.status == 429 else "unavailable"
    body = error_body(str(exc), kind, code=exc.status, reason=exc.reason)
    response = json_response(body, exc.status)
    response.headers["retry-after"] = str(exc.retry_after_s)
    return response


def _too_big(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (agent.front.max_body_bytes)"


async def _bounded_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body read within ``limit`` bytes and ``timeout_s`` (a slow client gets 408)."""
    parts: list[bytes] = []
    size = 0
    # Closed at once when it is refused part-way (not left to the collector).
    with trio.move_on_after(timeout_s) as scope:
        async with aclosing(request.stream()) as arriving:
            async for part in arriving:
                size += len(part)
                if size > limit:
                    raise BodyError(413, _too_big(limit), "request_too_large")
                parts.append(part)
    if scope.cancelled_caught:
        raise BodyError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (agent.front.body_timeout_s)",
            "timeout",
        )
    return b"".join(parts)
