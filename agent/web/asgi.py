"""A small ASGI toolkit on hypercorn + trio: routes, requests, JSON/text/streamed responses.

Shared by the agent's endpoint and the stand-in engines so that neither writes an HTTP server.
Handlers are ``async def handler(request) -> Response``; a ``StreamingResponse`` sends an async
iterator chunk by chunk (and its ``finally`` runs when the client hangs up, which matters for the
decode stand-in's busy flag).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import hypercorn.config
import hypercorn.trio
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

    async def stream(self) -> AsyncIterator[bytes]:
        """The request body part by part as it arrives (read once; a caller that must bound
        its size or its time reads it this way)."""
        while True:
            message = await self._receive()
            yield message.get("body", b"")
            if not message.get("more_body"):
                break

    async def json(self) -> Any:
        """The body decoded as JSON; raises ``HTTPError(400)`` when it is not."""
        try:
            return msgspec.json.decode(await self.body())
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"request body is not JSON: {exc}") from None


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


class HTTPError(TilertError):
    """Raise from a handler to answer ``status`` with a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]

log = logging.getLogger(__name__)


class App:
    """An ASGI app that dispatches on (method, path) to handlers."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        """Register a handler: ``@app.route("GET", "/health")``."""

        def register(handler: Handler) -> Handler:
            self.routes[(method, path)] = handler
            return handler

        return register

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        request = Request(scope["method"], scope["path"], query, headers, receive)
        handler = self.routes.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                known = any(path == scope["path"] for _, path in self.routes)
                raise HTTPError(
                    405 if known else 404, f"no route {scope['method']} {scope['path']}"
                )
            response = await handler(request)
        except HTTPError as exc:
            response = json_response({"error": exc.message}, exc.status)
        except Exception:
            log.exception("handler for %s %s failed", scope["method"], scope["path"])
            response = json_response({"error": "internal error"}, 500)
        await _send_response(send, receive, response)


async def _send_response(
    send: Send, receive: Receive, response: Response | StreamingResponse
) -> None:
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if isinstance(response, Response):
        await send({"type": "http.response.body", "body": response.body})
        return
    # hypercorn drops sends after a hang-up without raising, so watch for the disconnect ourselves
    # and cancel the iteration: that runs the async generator's ``finally`` at once.
    async with trio.open_nursery() as nursery:

        async def cancel_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_on_disconnect)
        try:
            async for chunk in response.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            aclose = getattr(response.chunks, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
        nursery.cancel_scope.cancel()


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``::`` is dual-stack), ready to hand to
    ``serve``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


async def serve(
    app: App,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    shutdown: trio.Event | None = None,
) -> None:
    """Serve ``app`` on an already bound socket until cancelled (or until ``shutdown`` is set)."""
    config = hypercorn.config.Config()
    # hypercorn wraps the fd in a socket object of its own: hand the fd over (detach) so that the
    # caller's object, when collected, cannot close a descriptor number reused later.
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = "WARNING"
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 75.0
    event = shutdown if shutdown is not None else trio.Event()
    task_status.started()
    await hypercorn.trio.serve(app, config, shutdown_trigger=event.wait)  # type: ignore[arg-type]
