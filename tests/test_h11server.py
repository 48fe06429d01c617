"""agent/web/h11server.py on real sockets: what the fronts' server keeps from hypercorn's (bounded
heads, malformed requests, ``Expect: 100-continue``, keep-alive and its timeout, a client gone
before its answer, a body the app refused unread, a graceful shutdown, a failing connection
contained). The streams' ends for HTTP/1.0 and ``Connection: close``, #203's malformed connection
and the accept that fails: tests/test_web.py, on both servers.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
import trio

from agent.web import h11server, server
from agent.web.asgi import App, Request, Response, Scope
from agent.web.h11server import serve
from agent.web.server import bound_socket
from tests.kit.endpoints import exchange

WAIT_S = 10.0


class Probe:
    """The test app's witnesses: whether a handler was cancelled, whether one is waiting."""

    def __init__(self) -> None:
        self.waiting = trio.Event()
        self.left = trio.Event()
        self.release = trio.Event()


def probe_app(probe: Probe) -> App:
    """``/echo``: the body back; ``/refuse``: 413 without reading the body; ``/wait``: waits for
    ``probe.release`` (as a request in the admission queue), ``probe.left`` set if cancelled."""
    app = App()

    async def echo(request: Request) -> Response:
        return Response(await request.body())

    async def refuse(_request: Request) -> Response:
        return Response(b"too large", 413)

    async def wait(_request: Request) -> Response:
        probe.waiting.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.left.set()
            raise
        return Response(b"released")

    app.route("POST", "/echo")(echo)
    app.route("POST", "/refuse")(refuse)
    app.route("GET", "/wait")(wait)
    return app


@pytest.fixture
async def port(nursery: trio.Nursery) -> tuple[int, Probe]:
    """The probe app served on a free port."""
    probe = Probe()
    sock = bound_socket("127.0.0.1", 0)
    number = sock.getsockname()[1]
    await nursery.start(serve, probe_app(probe), sock)
    return number, probe


async def raw(port: int, request: bytes) -> bytes:
    """``request`` sent on a new connection, everything read until the server closes it."""
    return await trio.to_thread.run_sync(exchange, port, request, WAIT_S)


async def read_until(stream: trio.SocketStream, marker: bytes, seen: bytes = b"") -> bytes:
    """Read ``stream`` until ``marker`` has arrived (bounded)."""
    with trio.fail_after(WAIT_S):
        while marker not in seen:
            data = await stream.receive_some(65536)
            assert data, f"closed before {marker!r}: {seen!r}"
            seen += data
    return seen


async def test_a_head_too_large_is_431_and_a_malformed_one_400(port: tuple[int, Probe]) -> None:
    number, _ = port
    # h11 bounds the head it holds incomplete: more than a read's 64 KiB past 16 KiB
    big = b"GET /wait HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    assert (await raw(number, big)).startswith(b"HTTP/1.1 431 ")
    assert (await raw(number, b"NOT HTTP AT ALL\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    bad_length = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n"
    assert (await raw(number, bad_length)).startswith(b"HTTP/1.1 400 ")


async def test_expect_100_continue_then_the_body(port: tuple[int, Probe]) -> None:
    """The 100 comes when the app reads the body, which the client sends only then."""
    number, _ = port
    stream = await trio.open_tcp_stream("127.0.0.1", number)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    await stream.send_all(head)
    seen = await read_until(stream, b"HTTP/1.1 100 ")
    await stream.send_all(b"hello")
    seen = await read_until(stream, b"\r\n0\r\n\r\n", seen)
    assert b"HTTP/1.1 200 " in seen
    assert b"hello" in seen
    await stream.aclose()


async def test_requests_kept_alive_pipelined_and_chunked(port: tuple[int, Probe]) -> None:
    """Two requests in one write (the second's body chunked) get two answers on the connection."""
    number, _ = port
    stream = await trio.open_tcp_stream("127.0.0.1", number)
    await stream.send_all(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\ntwo\r\n4\r\nfour\r\n0\r\n\r\n"
    )
    seen = await read_until(stream, b"twofour")
    assert seen.count(b"HTTP/1.1 200 ") == 2
    assert b"one" in seen
    await stream.aclose()


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(
    port: tuple[int, Probe], monkeypatch: pytest.MonkeyPatch
) -> None:
    number, _ = port
    monkeypatch.setattr(h11server, "KEEP_ALIVE_S", 0.2)
    stream = await trio.open_tcp_stream("127.0.0.1", number)
    await stream.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    seen = await read_until(stream, b"hi\r\n0\r\n\r\n")
    with trio.fail_after(WAIT_S):
        while data := await stream.receive_some(65536):
            seen += data
    await stream.aclose()


async def test_a_client_gone_before_its_answer_cancels_the_handler(
    port: tuple[int, Probe],
) -> None:
    """A request waiting (as in the admission queue) whose client leaves gives its place up at
    once; the server goes on serving."""
    number, probe = port
    stream = await trio.open_tcp_stream("127.0.0.1", number)
    await stream.send_all(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
    with trio.fail_after(WAIT_S):
        await probe.waiting.wait()
    await stream.aclose()
    with trio.fail_after(WAIT_S):
        await probe.left.wait()
    reply = await raw(number, b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nok")
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.endswith(b"ok")


def refused_with_body(port: int, size: int, then: bytes) -> bytes:
    """A body of ``size`` bytes the app does not read, sent whole, then ``then``; everything
    read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        conn.sendall(b"x" * size + then)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data


async def test_a_body_the_app_did_not_read_is_drained_not_reset(port: tuple[int, Probe]) -> None:
    """A client still sending a body the app answered without reads the 413 whole (not a
    reset), and its connection carries the next request."""
    number, _ = port
    then = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnext"
    reply = await trio.to_thread.run_sync(refused_with_body, number, 4 << 20, then)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"too large" in reply
    assert reply.count(b"HTTP/1.1 200 ") == 1
    assert reply.endswith(b"next\r\n0\r\n\r\n")  # the echo, chunked: the client is HTTP/1.1


async def test_shutdown_closes_idle_connections_and_finishes_answers() -> None:
    """Once ``shutdown`` is set: no new connection, an idle kept connection closed, a request
    under way answered within the grace."""
    probe, shutdown = Probe(), trio.Event()
    sock = bound_socket("127.0.0.1", 0)
    number = sock.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve(
                probe_app(probe), sock, task_status=task_status, shutdown=shutdown
            )
        )
        idle = await trio.open_tcp_stream("127.0.0.1", number)
        await idle.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        await read_until(idle, b"hi\r\n0\r\n\r\n")
        busy = await trio.open_tcp_stream("127.0.0.1", number)
        await busy.send_all(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(WAIT_S):
            await probe.waiting.wait()
        shutdown.set()
        with trio.fail_after(WAIT_S):
            assert await idle.receive_some(65536) == b""
        probe.release.set()
        assert b"released" in await read_until(busy, b"released")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", number), timeout=WAIT_S).close()
    await idle.aclose()
    await busy.aclose()


async def test_a_failing_connection_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    """An app that raises closes its connection alone, logged with its traceback once; the
    server answers the next connection."""

    async def app(scope: Scope, _receive: Any, send: Any) -> None:
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"fine"})

    sock = bound_socket("127.0.0.1", 0)
    number = sock.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, sock)
            for _ in range(2):
                assert await raw(number, b"GET /boom HTTP/1.0\r\n\r\n") == b""
            assert (await raw(number, b"GET /ok HTTP/1.0\r\n\r\n")).endswith(b"fine")
            nursery.cancel_scope.cancel()
    failures = [r for r in caplog.records if "a connection failed (RuntimeError" in r.msg % r.args]
    assert len(failures) == 2
    assert [bool(r.exc_info) for r in failures] == [True, False]
