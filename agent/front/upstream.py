"""The front's client to the router: h11 on trio's own streams, a pool of kept-alive
connections per router origin.

Every streamed event crosses this client, and httpx's (its URL and request models, httpcore's
pool and its per-read layers) was about a quarter of the front's CPU per event
(docs/performance.md, "The front's cost"). The front sends one kind of request, a POST of a JSON
body to one router, and reads the reply's body as it arrives, so this does exactly that with h11
(the HTTP/1.1 rules: chunked or sized bodies, keep-alive) and nothing else: each read is one
``receive_some`` of at most ``READ_BYTES``, every wait bounded (``CONNECT_TIMEOUT_S``,
``READ_TIMEOUT_S``), and a connection goes back to its pool only once its reply was read to its
end. A kept-alive connection the router closed while idle (a hand-over starts a new router on the
same port) is opened again once at once, as httpx does, so it is not taken for a router that does
not answer.

``Upstream`` is what ``agent.front.proxy`` needs of a client; ``HttpxUpstream`` is the same over an
``httpx.AsyncClient`` (the router in process, for tests/kit/front.py). Every failure is an
``UpstreamError`` (``refused``: nothing listens).
"""

from __future__ import annotations

import errno
import select
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import h11
import httpx
import trio

from agent.errors import RuntimeFailure

CONNECT_TIMEOUT_S = 5.0
# A stream may wait this long for its next event (TileRT's own bound: TILERT_PD_HTTP_TIMEOUT_S).
READ_TIMEOUT_S = 3600.0
WRITE_TIMEOUT_S = 60.0
READ_BYTES = 64 * 1024
MAX_IDLE_PER_ORIGIN = 256


class UpstreamError(RuntimeFailure):
    """The router could not be reached (``refused``: nothing listens) or broke off its reply."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Reply(Protocol):
    """The router's reply: its status and content type now, its body as it arrives."""

    status: int
    content_type: str

    def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (raises ``UpstreamError`` when it breaks off)."""
        ...

    async def aclose(self) -> None:
        """Done with the reply (read to its end or not)."""
        ...


class Upstream(Protocol):
    """What the proxy needs of a client: a JSON POST, its reply."""

    async def post(self, url: str, body: bytes) -> Reply:
        """POST ``body`` (JSON) to ``url``; raises ``UpstreamError``."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


class _Connection:
    """One kept-alive connection: its stream and its h11 state."""

    def __init__(self, stream: trio.SocketStream, origin: tuple[str, int]) -> None:
        self.stream = stream
        self.origin = origin
        self.h11 = h11.Connection(h11.CLIENT)
        self.received = 0  # bytes of this request's reply so far

    def stale(self) -> bool:
        """Whether the router closed this idle connection (or sent on it unasked): readable now."""
        ready, _, _ = select.select([self.stream.socket.fileno()], [], [], 0)
        return bool(ready)

    async def next_event(self) -> object:
        """h11's next event, reading from the router as it needs (bounded)."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"the router's reply broke the HTTP rules: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            # A scope made directly: ``move_on_after``'s context-manager wrapper was a twentieth
            # of the front's CPU per event.
            with trio.CancelScope(deadline=trio.current_time() + READ_TIMEOUT_S) as scope:
                try:
                    data = await self.stream.receive_some(READ_BYTES)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError(f"the router's connection broke: {exc!r}") from None
            if scope.cancelled_caught:
                raise UpstreamError(f"the router sent nothing for {READ_TIMEOUT_S:g} s")
            self.received += len(data)
            self.h11.receive_data(data)


class H11Reply:
    """A reply read from its connection; the connection given back to the pool at its end."""

    def __init__(self, conn: _Connection, response: h11.Response, pool: H11Upstream) -> None:
        self.conn: _Connection | None = conn
        self.pool = pool
        self.status = response.status_code
        self.content_type = "application/json"
        for name, value in response.headers:
            if name == b"content-type":
                self.content_type = value.decode("latin-1")

    def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        # A class, not an async generator: one left part-way is closed by ``aclose`` (its
        # connection), never by the collector.
        conn = self.conn
        if conn is None:
            raise StopAsyncIteration
        event = await conn.next_event()
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            self.conn = None
            self.pool.give_back(conn)
            raise StopAsyncIteration
        raise UpstreamError("peer closed connection without sending complete message body")

    async def aclose(self) -> None:
        """A reply not read to its end: its connection closed, never reused."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()


class H11Upstream:
    """Kept-alive connections per router origin, one request at a time on each."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[_Connection]] = {}

    def give_back(self, conn: _Connection) -> None:
        """A connection whose reply was read to its end: kept for the next request."""
        kept = self.idle.setdefault(conn.origin, [])
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            if len(kept) < MAX_IDLE_PER_ORIGIN:
                conn.received = 0
                kept.append(conn)
                return
        conn.stream.socket.close()

    async def post(self, url: str, body: bytes) -> Reply:
        """POST ``body`` to ``url``: on a kept connection, else on a new one; once more on a new
        one when the router had closed the kept one (it ended without a byte of answer)."""
        parts = urlsplit(url)
        origin = (parts.hostname or "127.0.0.1", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [
            ("host", parts.netloc),
            ("content-type", "application/json"),
            ("accept", "*/*"),
            ("content-length", str(len(body))),
        ]
        request = h11.Request(method="POST", target=target, headers=headers)
        kept = self.idle.get(origin) or []
        while kept:
            conn = kept.pop()
            if conn.stale():
                await conn.stream.aclose()
                continue
            try:
                return await self._exchange(conn, request, body)
            except UpstreamError:
                if conn.received:
                    raise
            break  # closed under us before answering: once more on a new connection
        return await self._exchange(await _connect(origin), request, body)

    async def _exchange(self, conn: _Connection, request: h11.Request, body: bytes) -> Reply:
        data = b"".join(
            conn.h11.send(event) or b""
            for event in (request, h11.Data(data=body), h11.EndOfMessage())
        )
        try:
            with trio.fail_after(WRITE_TIMEOUT_S):
                await conn.stream.send_all(data)
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Response):
                    return H11Reply(conn, event, self)
                if not isinstance(event, h11.InformationalResponse):
                    raise UpstreamError("the router closed the connection before answering")
        except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
            await conn.stream.aclose()
            raise UpstreamError(f"the router's connection broke: {exc!r}") from None
        except BaseException:
            await conn.stream.aclose()
            raise

    async def aclose(self) -> None:
        """Close every kept connection."""
        idle, self.idle = self.idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.stream.aclose()


async def _connect(origin: tuple[str, int]) -> _Connection:
    host, port = origin
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise UpstreamError(
            f"connecting to {host}:{port} took over {CONNECT_TIMEOUT_S:g} s"
        ) from None
    except OSError as exc:
        refused = _refused(exc)
        raise UpstreamError(
            f"connecting to {host}:{port} failed: {exc!r}", refused=refused
        ) from None
    return _Connection(stream, origin)


def _refused(exc: BaseException) -> bool:
    """Whether every address refused the connection (trio's ``open_tcp_stream`` raises one
    OSError caused by each address's own)."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(_refused(e) for e in cause.exceptions)
    if cause is not None:
        return _refused(cause)
    return (
        isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED
    )


class _HttpxReply:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "application/json")
        self.parts = response.aiter_raw()

    def body(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await anext(self.parts)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"the router's stream broke: {exc!r}") from None

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.response.aclose()


class HttpxUpstream:
    """``Upstream`` over an ``httpx.AsyncClient`` (a transport handed in: the router in
    process, for tests)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, body: bytes) -> Reply:
        """POST ``body`` to ``url`` through the client."""
        headers = {"content-type": "application/json", "accept": "*/*"}
        request = self.client.build_request("POST", url, content=body, headers=headers)
        try:
            return _HttpxReply(await self.client.send(request, stream=True))
        except httpx.ConnectError as exc:
            raise UpstreamError(f"refused the connection: {exc!r}", refused=True) from None
        except httpx.TransportError as exc:
            raise UpstreamError(f"failed to answer: {exc!r}") from None

    async def aclose(self) -> None:
        """Close the client."""
        await self.client.aclose()
