"""A small ASGI toolkit on hypercorn + trio: routes, requests, JSON/text/streamed responses.

Shared by the agent's endpoint and the stand-in engines so that neither writes an HTTP server.
Handlers are ``async def handler(request) -> Response``; a ``StreamingResponse`` sends an async
iterator chunk by chunk (and its ``finally`` runs when the client hangs up, which matters for the
decode stand-in's busy flag).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import msgspec
import trio

from agent.errors import TilertError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    _receive: Receive
    _body: bytes | None = None

    async def body(self) -> bytes:
        """The whole request body (read once, cached)."""
        if self._body is None:
            self._body = b"".join([chunk async for chunk in self.stream()])
        return self._body

    async def stream(self) -> AsyncGenerator[bytes]:
        """The request body part by part as it arrives (read once; a caller that must bound
        its size or its time reads it this way)."""
        while True:
            message = await self._receive()
            yield message.get("body", b"")
            if not message.get("more_body"):
                break

    async def json(self) -> Any:
        """The body decoded as JSON; raises ``HTTPError(400)`` when it is not."""
        return decode_json(await self.body())


def decode_json(body: bytes) -> Any:
    """A request body decoded as JSON, or ``HTTPError(400)`` saying why not: every handler's
    one decoder, so that no client's body can make a 500 (msgspec raises RecursionError, not
    DecodeError, on arrays or objects nested deeper than Python's recursion limit)."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"the request body is not JSON: {exc}") from None
    except RecursionError:
        raise HTTPError(400, "the request body is JSON nested too deeply") from None


@dataclass
class Response:
    body: bytes = b""
    status: int = 200
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(data: Any, status: int = 200) -> Response:
    """A JSON response (msgspec encodes Structs, dicts and lists)."""
    return Response(msgspec.json.encode(data), status, "application/json")


def text_response(text: str, status: int = 200, content_type: str | None = None) -> Response:
    """A plain-text response."""
    return Response(text.encode(), status, content_type or "text/plain; charset=utf-8")


@dataclass
class StreamingResponse:
    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)
    # Awaited once the response is done with, whether or not ``chunks`` ever ran: an async
    # generator cancelled before its first step never runs its ``finally``, so what it holds
    # (an upstream stream, a slot) is given back here too.
    closed: Callable[[], Awaitable[None]] | None = None


class HTTPError(TilertError):
    """Raise from a handler to answer ``status`` with a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]

log = logging.getLogger(__name__)


def error_response(status: int, message: str) -> Response:
    """The default answer to an ``HTTPError``: JSON ``{"error": message}``."""
    return json_response({"error": message}, status)


class App:
    """An ASGI app that dispatches on (method, path) to handlers; ``errors`` shapes the answer
    to an ``HTTPError`` (one a handler raised, or a route or a header refused here) and the 500
    of a handler that failed."""

    def __init__(self, errors: Callable[[int, str], Response] = error_response) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.errors = errors

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        """Register a handler: ``@app.route("GET", "/health")``."""

        def register(handler: Handler) -> Handler:
            self.routes[(method, path)] = handler
            return handler

        return register

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            request = _request(scope, receive)
            handler = self.routes.get((request.method, request.path))
            if handler is None:
                known = any(path == request.path for _, path in self.routes)
                raise HTTPError(405 if known else 404, f"no route {request.method} {request.path}")
            response = await handler(request)
        except HTTPError as exc:
            response = self.errors(exc.status, exc.message)
        except Exception:
            log.exception("handler for %s %s failed", scope["method"], scope["path"])
            response = self.errors(500, "internal error")
        await _send_response(send, receive, response)


def _request(scope: Scope, receive: Receive) -> Request:
    """The request a handler sees; a header or query that is not UTF-8 is the client's to fix
    (400), decoded here once for every route."""
    try:
        pairs = parse_qs(scope.get("query_string", b"").decode(), errors="strict")
    except UnicodeDecodeError:
        raise HTTPError(400, "the query string is not UTF-8 (after %-decoding)") from None
    query = {k: v[-1] for k, v in pairs.items()}
    headers: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        try:
            headers[name.decode().lower()] = value.decode()
        except UnicodeDecodeError:
            shown = name.decode("latin-1")[:100]
            raise HTTPError(400, f"the value of header {shown!r} is not UTF-8") from None
    return Request(scope["method"], scope["path"], query, headers, receive)


async def _send_response(
    send: Send, receive: Receive, response: Response | StreamingResponse
) -> None:
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    start = {"type": "http.response.start", "status": response.status, "headers": headers}
    if isinstance(response, Response):
        await send(start)
        await send({"type": "http.response.body", "body": response.body})
        return
    try:
        await send(start)
        await _send_chunks(send, receive, response)
    finally:
        if response.closed is not None:
            with trio.CancelScope(shield=True):
                await response.closed()


async def _send_chunks(send: Send, receive: Receive, response: StreamingResponse) -> None:
    # hypercorn drops sends after a hang-up without raising, so watch for the disconnect ourselves
    # and cancel the iteration: that runs the async generator's ``finally`` at once.
    ended = False
    async with trio.open_nursery() as nursery:

        async def cancel_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_on_disconnect)
        try:
            async for chunk in response.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            ended = True
        finally:
            aclose = getattr(response.chunks, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
        nursery.cancel_scope.cancel()
    # The last send outside that scope: it is the one that ends the response, and for a client
    # that cannot keep the connection (HTTP/1.0, ``Connection: close``: no chunked end) it
    # closes the connection, which is when hypercorn hands us the disconnect. Sent inside, the
    # disconnect cancelled its own close and the client waited for the job to end.
    if ended:
        await send({"type": "http.response.body", "body": b""})
