"""The front's client to the router (``agent.front.upstream``) against a real socket: a chunked
stream read as it arrives on one kept connection, a connection the router closed while idle
opened again at once, a reply left part-way never reused, a cut body and a refused connection
each an ``UpstreamError`` that says so."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from agent.front.upstream import H11Upstream, Reply, UpstreamError
from tests.infra.ports import free_port
from tests.kit.rawhttp import RawServer

CHAT = "/v1/chat/completions"
BODY = b'{"model": "m", "stream": true}'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_all(reply: Reply) -> list[bytes]:
    return [part async for part in reply.body()]


async def stream_two(stream: trio.SocketStream, _head: bytes) -> bool:
    await stream.send_all(HEAD + chunk(b"data: 1\n\n"))
    await trio.sleep(0.01)  # a second read: the parts arrive as they are sent
    await stream.send_all(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return True


async def test_a_chunked_stream_is_read_as_it_arrives_on_one_kept_connection() -> None:
    async with trio.open_nursery() as nursery:
        router = RawServer(stream_two, CHAT)
        url = await router.start(nursery)
        upstream = H11Upstream()
        for _ in range(2):
            reply = await upstream.post(url, BODY)
            assert (reply.status, reply.content_type) == (200, "text/event-stream")
            assert await read_all(reply) == [b"data: 1\n\n", b"data: [DONE]\n\n"]
        await upstream.aclose()
        nursery.cancel_scope.cancel()
    assert router.bodies == [BODY, BODY]
    assert router.connections == 1


async def test_a_connection_closed_while_idle_is_opened_again_at_once() -> None:
    async def once(stream: trio.SocketStream, head: bytes) -> bool:
        await stream_two(stream, head)
        return False  # a router handed over: the kept connection is closed

    async with trio.open_nursery() as nursery:
        router = RawServer(once, CHAT)
        url = await router.start(nursery)
        upstream = H11Upstream()
        assert len(await read_all(await upstream.post(url, BODY))) == 2
        await trio.testing.wait_all_tasks_blocked()
        assert len(await read_all(await upstream.post(url, BODY))) == 2
        await upstream.aclose()
        nursery.cancel_scope.cancel()
    assert (len(router.bodies), router.connections) == (2, 2)


async def test_a_reply_left_part_way_is_closed_never_reused() -> None:
    async with trio.open_nursery() as nursery:
        router = RawServer(stream_two, CHAT)
        url = await router.start(nursery)
        upstream = H11Upstream()
        reply = await upstream.post(url, BODY)
        assert await anext(reply.body()) == b"data: 1\n\n"
        await reply.aclose()  # the client left mid-stream
        assert len(await read_all(await upstream.post(url, BODY))) == 2
        await upstream.aclose()
        nursery.cancel_scope.cancel()
    assert router.connections == 2


async def test_a_body_cut_mid_way_says_so() -> None:
    async def cut(stream: trio.SocketStream, _head: bytes) -> bool:
        await stream.send_all(HEAD + chunk(b"data: 1\n\n"))
        return False  # the router died mid-stream

    async with trio.open_nursery() as nursery:
        url = await RawServer(cut, CHAT).start(nursery)
        upstream = H11Upstream()
        reply = await upstream.post(url, BODY)
        with pytest.raises(UpstreamError, match="without sending complete message body"):
            await read_all(reply)
        await reply.aclose()
        await upstream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_refused_connection_is_said_refused() -> None:
    upstream = H11Upstream()
    with pytest.raises(UpstreamError) as caught:
        await upstream.post(f"http://127.0.0.1:{free_port()}/v1/chat/completions", BODY)
    assert caught.value.refused
