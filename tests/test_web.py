"""agent/web: what no client can do to a server (docs/reliability.md, "Servers contained").

In process: the apps called directly (every route of the front door and of the agent's endpoint:
a header that is not UTF-8, JSON nested 100000 deep: 400, never a 500), and ``serve`` on a real
socket with raw clients (pgjones/hypercorn#203's malformed connection, HTTP/1.0 and
``Connection: close`` streams, an accept that fails). The same against running agents and
stand-ins: tests/test_hostile_clients.py.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
import trio
from hypercorn.trio.tcp_server import TCPServer

from agent.front import Front, RouterNow
from agent.front.figures import FrontFigures
from agent.http.endpoint import StatusFeed, build_app
from agent.job.frontpolicy import FrontPolicy
from agent.web import h11server, server
from agent.web.asgi import App, Request, Response, StreamingResponse, json_response
from agent.web.server import bound_socket, serve
from tests.kit.endpoints import exchange
from tests.kit.front import Client
from tests.kit.front import call as in_process

NESTED = b"[" * 100_000
LATIN1 = "caf\xe9".encode("latin-1")  # a Latin-1 byte that starts no UTF-8 sequence
MALFORMED_TRIES = 100
WAIT_S = 30.0


async def call(
    app: App, method: str, path: str, headers: Iterable[tuple[bytes, bytes]] = (), body: bytes = b""
) -> tuple[int, bytes]:
    """One request through the ASGI app in process (tests/kit/front.py): its status and body (a
    streamed reply is hung up on at its first part)."""
    got = await in_process(app, method, path, Client((body,), leave_after=1), list(headers))
    return got.status, got.body


def front_app() -> App:
    """The front door's app, with no router yet."""
    return Front(
        model="m",
        policy=FrontPolicy(),
        router=lambda: RouterNow(None, False, "no router in this test"),
        figures=FrontFigures(None, {"agent": "prefill-0"}),
        capacity=lambda: 0,
    ).app


def endpoint_app() -> App:
    """An agent endpoint's app (its status never asked for here)."""

    def no_status() -> Any:
        raise AssertionError("not asked")

    async def page(_budget: float | None) -> str:
        return ""

    return build_app(
        feed=StatusFeed(no_status),
        metrics_page=page,
        token=lambda: "t",
        log_files=dict,
        on_leave=lambda: "leaving",
    )


@pytest.mark.parametrize("make", [front_app, endpoint_app], ids=["front", "endpoint"])
async def test_every_route_answers_bad_input_with_400_not_500(make: Any) -> None:
    """A header value that is not UTF-8 is 400 naming the header, on every route; JSON nested
    100000 deep is never a 500, and a 400 wherever a body is read (msgspec raises
    RecursionError on it: it was a 500)."""
    app = make()
    assert app.routes
    for method, path in app.routes:
        status, body = await call(app, method, path, [(b"x-name", LATIN1)])
        assert status == 400, (method, path, body)
        assert b"'x-name' is not UTF-8" in body
        if method == "POST":
            headers = [(b"authorization", b"Bearer t"), (b"content-type", b"application/json")]
            status, body = await call(app, method, path, headers, NESTED)
            assert status < 500, (method, path, body)  # /leave reads no body: 200
    status, body = await call(front_app(), "POST", "/v1/chat/completions", (), NESTED)
    assert (status, b"nested too deeply" in body) == (400, True)
    # The front answers in OpenAI's error shape even what the toolkit refuses before a handler.
    status, body = await call(front_app(), "GET", "/v1/models", [(b"x-name", LATIN1)])
    assert json.loads(body)["error"]["type"] == "invalid_request"


def streaming_app(ended: trio.Event) -> App:
    """``/stream``: three events; ``/fast``, ``/slow``: a JSON answer at once, after a moment;
    ``/long``: a stream
    that waits for its client to hang up (``ended`` is set when it has)."""
    app = App()

    async def three() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"data: %d\n\n" % i
            await trio.lowlevel.checkpoint()

    async def until_gone() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await trio.sleep_forever()
        finally:
            ended.set()

    async def stream(_request: Request) -> StreamingResponse:
        return StreamingResponse(three())

    async def long(_request: Request) -> StreamingResponse:
        return StreamingResponse(until_gone())

    async def slow(_request: Request) -> Response:
        await trio.sleep(0.01)
        return json_response({"ok": True})

    async def fast(_request: Request) -> Response:
        return json_response({"ok": True})

    app.route("GET", "/stream")(stream)
    app.route("GET", "/long")(long)
    app.route("GET", "/slow")(slow)
    app.route("GET", "/fast")(fast)
    return app


async def open_long(port: int) -> trio.SocketStream:
    """A connection on which ``/long``'s first event has arrived."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
    seen = b""
    with trio.fail_after(WAIT_S):
        while b"data: first" not in seen:
            seen += await stream.receive_some(65536)
    return stream


SERVERS = pytest.mark.parametrize("serve", [serve, h11server.serve], ids=["hypercorn", "h11"])


@SERVERS
async def test_a_stream_ends_at_its_last_event_for_every_client(serve: Any) -> None:
    """HTTP/1.0 (no chunked encoding) and ``Connection: close`` clients get the whole stream and
    then the server's close; a keep-alive client gets the chunked end; a client gone mid-stream
    ends the stream (its generator's ``finally`` runs)."""
    ended = trio.Event()
    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, streaming_app(ended), sock)
        for request in (
            b"GET /stream HTTP/1.0\r\n\r\n",
            b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ):
            # exchange() returns only once the server closed: a timeout here is the defect.
            reply = await trio.to_thread.run_sync(exchange, port, request)
            assert reply.startswith(b"HTTP/1.1 200"), reply
            assert b"data: 2\n\n" in reply, reply
        stream = await open_long(port)
        await stream.aclose()
        with trio.fail_after(WAIT_S):
            await ended.wait()
        nursery.cancel_scope.cancel()


def malformed(port: int, path: str, tries: int) -> list[bytes]:
    """pgjones/hypercorn#203: a ``Connection: close`` request with stray bytes after it."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    out = []
    for _ in range(tries):
        try:
            out.append(exchange(port, request + b"XXXX"))
        except ConnectionResetError:
            out.append(b"reset")
    return out


async def _malformed_beside_a_stream(
    caplog: pytest.LogCaptureFixture, serve: Any = serve
) -> list[str]:
    """Malformed connections at ``/health``-like and slower routes while a stream is open: the
    stream stays whole, the server answers after; the contained failures logged."""
    ended = trio.Event()
    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, streaming_app(ended), sock)
            stream = await open_long(port)
            for path in ("/fast", "/slow", "/stream"):
                await trio.to_thread.run_sync(malformed, port, path, MALFORMED_TRIES)
            assert not ended.is_set()  # the open stream was never cut
            reply = await trio.to_thread.run_sync(exchange, port, b"GET /slow HTTP/1.0\r\n\r\n")
            assert b'{"ok":true}' in reply
            await stream.aclose()
            nursery.cancel_scope.cancel()
    return [r.getMessage() for r in caplog.records if "a connection failed" in r.getMessage()]


@SERVERS
async def test_the_malformed_connection_no_longer_races(
    caplog: pytest.LogCaptureFixture, serve: Any
) -> None:
    """With the close under the send lock (hypercorn), or h11's own close, #203's connection
    fails nothing at all."""
    assert await _malformed_beside_a_stream(caplog, serve) == []


async def test_a_failing_connection_is_contained(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hypercorn's own close put back (the race live again): each connection that raises is
    closed alone and logged, its traceback once; other streams and the server go on."""

    async def racy_close(self: TCPServer) -> None:
        # hypercorn's own close (#203 live again); the socket closed whatever it raises
        try:
            await TCPServer._close(self)
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    monkeypatch.setattr(server._Connection, "_close", racy_close)
    failures = await _malformed_beside_a_stream(caplog)
    assert failures, "the race never hit in the tries: the test proves nothing"
    assert all("BusyResourceError" in f for f in failures), failures
    tracebacks = [r for r in caplog.records if r.exc_info and "connection failed" in r.msg]
    assert len(tracebacks) == 1


class FailingOnce:
    """A listener whose first accept fails as a process out of descriptors would."""

    def __init__(self, listener: trio.SocketListener) -> None:
        self.listener = listener
        self.failed = False

    async def accept(self) -> trio.SocketStream:
        """EMFILE the first time, then the real accept."""
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.listener.accept()


async def test_accepting_goes_on_after_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """An accept that fails is logged and accepting goes on on the same socket."""
    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        async with trio.open_nursery() as nursery:
            flaky: Any = FailingOnce(listener)
            nursery.start_soon(server._Server(streaming_app(trio.Event())).accept, flaky, nursery)
            reply = await trio.to_thread.run_sync(exchange, port, b"GET /slow HTTP/1.0\r\n\r\n")
            assert b'{"ok":true}' in reply
            nursery.cancel_scope.cancel()
    await listener.aclose()
    assert [r.getMessage() for r in caplog.records] == [
        "accepting a connection failed: OSError(24, 'Too many open files'); accepting again"
    ]
