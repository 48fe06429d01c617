"""The head's bare long polls against a real socket: answers with a length or chunked, one
connection kept open, a connection the peer closed while idle opened again at once, and every
other failure a ``PollFailed`` that says what happened."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from agent.http.longpoll import BarePoll, PollFailed
from tests.infra.ports import free_port
from tests.kit.rawhttp import RawServer

STATUS = "/decode-1/status"
BODY = b'{"state": "healthy"}'


def with_length(body: bytes = BODY, code: int = 200, extra: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


async def test_an_answer_with_a_length_on_one_kept_connection() -> None:
    async def answer(stream: trio.SocketStream, _head: bytes) -> bool:
        await stream.send_all(with_length())
        return True

    async with trio.open_nursery() as nursery:
        server = RawServer(answer, STATUS)
        url = await server.start(nursery)
        poll = BarePoll()
        assert await poll(url, -1, 5.0, 2.0) == BODY
        assert await poll(url, 7, 5.0, 2.0) == BODY
        poll.close()
        nursery.cancel_scope.cancel()
    assert server.heads[0].startswith(b"GET /decode-1/status?after=-1&timeout=5 HTTP/1.1\r\n")
    assert server.heads[1].startswith(b"GET /decode-1/status?after=7&timeout=5 HTTP/1.1\r\n")
    assert server.connections == 1


async def test_a_chunked_answer_is_read_whole() -> None:
    # hypercorn sends the agent's JSON chunked when the app gives no length.
    async def answer(stream: trio.SocketStream, _head: bytes) -> bool:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\n"
            + BODY[:5]
            + b"\r\n"
            + f"{len(BODY) - 5:x};ext=1\r\n".encode()
            + BODY[5:]
            + b"\r\n0\r\n\r\n"
        )
        return True

    async with trio.open_nursery() as nursery:
        url = await RawServer(answer, STATUS).start(nursery)
        poll = BarePoll()
        assert await poll(url, -1, 5.0, 2.0) == BODY
        assert await poll(url, -1, 5.0, 2.0) == BODY  # the connection is still in step
        poll.close()
        nursery.cancel_scope.cancel()


async def test_a_connection_closed_while_idle_is_opened_again_at_once() -> None:
    async def answer(stream: trio.SocketStream, _head: bytes) -> bool:
        await stream.send_all(with_length())
        return False  # the peer closes it after answering (a restarted agent, an idle timeout)

    async with trio.open_nursery() as nursery:
        server = RawServer(answer, STATUS)
        url = await server.start(nursery)
        poll = BarePoll()
        assert await poll(url, -1, 5.0, 2.0) == BODY
        await trio.testing.wait_all_tasks_blocked()
        assert await poll(url, 3, 5.0, 2.0) == BODY
        poll.close()
        nursery.cancel_scope.cancel()
    assert (len(server.heads), server.connections) == (2, 2)


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (with_length(code=503, body=b"busy"), "answered HTTP 503: busy"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}", "without a length"),
        (with_length(body=b"", extra=b"Content-Length: nine\r\n"), "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{", "closed before the answer ended"),
    ],
)
async def test_an_unusable_answer_says_what_it_was(reply: bytes, says: str) -> None:
    async def answer(stream: trio.SocketStream, _head: bytes) -> bool:
        await stream.send_all(reply)
        return False

    async with trio.open_nursery() as nursery:
        url = await RawServer(answer, STATUS).start(nursery)
        poll = BarePoll()
        with pytest.raises(PollFailed, match=says):
            await poll(url, -1, 5.0, 2.0)
        poll.close()  # a 503 is an answer: its connection stays open for the next poll
        nursery.cancel_scope.cancel()


async def test_no_answer_within_the_bound_and_a_refused_connection_fail_the_poll() -> None:
    async def answer(_stream: trio.SocketStream, _head: bytes) -> bool:
        await trio.sleep_forever()
        return False

    async with trio.open_nursery() as nursery:
        url = await RawServer(answer, STATUS).start(nursery)
        with pytest.raises(PollFailed, match=r"no answer from .* within 0\.2s"):
            await BarePoll()(url, 1, 5.0, 0.2)
        nursery.cancel_scope.cancel()
    with pytest.raises(PollFailed, match=r"127\.0\.0\.1"):
        await BarePoll()(f"http://127.0.0.1:{free_port()}/decode-1/status", -1, 5.0, 2.0)
