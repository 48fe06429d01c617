"""The head's canaries on data alone: retry within the budget, a cut attempt, each cause named.

No process, socket or job is started: the canaries talk to an ``httpx.MockTransport``, and trio's
autojump clock waits out their budget.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from agent.front.sse import StreamReader, StreamWatch
from agent.head.canaries import (
    CANARY_RETRY_S,
    Canary,
    CanaryFailed,
    failure_cause,
    reply_text,
    run_canaries,
)
from agent.head.decisions import JobFailed

LOG = logging.getLogger("test_canaries")
ROUTER_LOG = Path("/j/logs/prefill-0/router.log")


def stream(*texts: str) -> bytes:
    chunks = [b'data: {"choices": [{"delta": {"content": "%s"}}]}\n\n' % t.encode() for t in texts]
    return b"".join(chunks) + b"data: [DONE]\n\n"


def mock_client(handler: Callable[[httpx.Request], Any]) -> httpx.AsyncClient:
    """A client like the agent's shared one, answered by ``handler``."""
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def canary(timeout_s: float = 30.0, attempt_timeout_s: float = 60.0) -> Canary:
    return Canary(
        router_url="http://router:8000",
        model="m",
        prompt="Hello",
        max_tokens=8,
        timeout_s=timeout_s,
        attempt_timeout_s=attempt_timeout_s,
    )


async def test_a_canary_attempt_that_hangs_is_cut_and_retried_and_says_timeout(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    attempts = 0

    class Hang(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield b'data: {"choices": [{"delta": {"content": ""}}]}\n\n'
            await trio.sleep_forever()

    def handler(_request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return httpx.Response(200, stream=Hang())

    start = trio.current_time()
    with pytest.raises(JobFailed) as failed:
        await run_canaries(
            canary(timeout_s=25.0, attempt_timeout_s=10.0),
            1,
            client=mock_client(handler),
            log=LOG,
            router_log=ROUTER_LOG,
        )
    # Three attempts of 10 s (the last cut at the budget's end), not one read of the whole budget.
    assert attempts == 3
    assert "canary 1: timeout: no answer within" in str(failed.value)
    assert "(agent.canary.attempt_timeout_s) (attempt 3)" in str(failed.value)
    assert 25.0 <= trio.current_time() - start <= 25.0 + 10.0 + 2 * CANARY_RETRY_S


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (httpx.ConnectError(""), "connection refused or failed: ConnectError"),
        (httpx.ConnectTimeout(""), "timeout: no connection to the router within 5s"),
        (httpx.ReadTimeout(""), "timeout: ReadTimeout"),
        (httpx.RemoteProtocolError("peer closed"), "the router broke the connection: peer closed"),
        (
            CanaryFailed("router answered HTTP 502: bad gateway"),
            "router answered HTTP 502: bad gateway",
        ),
    ],
)
def test_every_canary_failure_names_its_cause(exc: Exception, cause: str) -> None:
    assert failure_cause(exc) == cause


def read(events: bytes) -> StreamWatch:
    """What the front's reader makes of a canary's reply (``events``)."""
    reader = StreamReader(mock_chunks(), StreamWatch(keep_text=True))
    reader.feed(events)
    return reader.watch


async def mock_chunks() -> AsyncIterator[bytes]:
    """No chunks: ``read`` feeds its reader by hand."""
    none: tuple[bytes, ...] = ()
    for chunk in none:
        yield chunk


def test_a_canarys_reply_is_read_by_the_fronts_reader() -> None:
    assert read(b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n').text == "Hi"
    assert read(b"data: [DONE]\n\n").text == ""
    assert read(b": keep-alive\n\n").text == ""
    assert read(b"data: not json\n\n").text == ""
    with pytest.raises(CanaryFailed, match="error chunk from the router: boom"):
        reply_text(read(b'data: {"error": "boom"}\n\n'))


async def test_a_canary_whose_reply_is_a_decode_error_fails(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """TileRT's router puts a decode's untyped error in the reply's text, then a ``stop``: the
    front marks such a reply cut, and a canary that gets one fails."""
    failed_decode = stream("Hel", "\\n[decode error: CUDA error: an illegal memory access]")

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=failed_decode)

    with pytest.raises(JobFailed) as failed:
        await run_canaries(
            canary(timeout_s=2.0), 1, client=mock_client(handler), log=LOG, router_log=ROUTER_LOG
        )
    assert (
        "canary 1: canary got an error chunk from the router: "
        "[decode error: CUDA error: an illegal memory access]"
    ) in str(failed.value)


async def test_a_canary_that_fails_then_answers_within_budget_passes(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = [
        httpx.Response(503, text="no decode yet"),
        httpx.Response(200, content=b'data: {"error": "decode-0 not connected"}\n\n'),
        httpx.Response(200, content=b"data: [DONE]\n\n"),
        httpx.Response(200, content=stream("Hello", " there")),
    ]
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return answers[min(len(requests), len(answers)) - 1]

    caplog.set_level(logging.INFO, LOG.name)
    start = trio.current_time()
    latencies = await run_canaries(
        canary(), 1, client=mock_client(handler), log=LOG, router_log=ROUTER_LOG
    )
    assert len(requests) == 4
    assert requests[0].url == "http://router:8000/v1/chat/completions"
    assert b'"stream":true' in requests[0].content
    assert len(latencies) == 1
    assert trio.current_time() - start == pytest.approx(3 * CANARY_RETRY_S)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "head: canary 1/1 not yet: router answered HTTP 503: no decode yet",
        "head: canary 1/1 not yet: canary got an error chunk from the router: "
        "decode-0 not connected",
        "head: canary 1/1 not yet: router streamed no text (1 event(s), then the stream ended)",
        "head: canary 1/1 answered 'Hello there'",
    ]


async def test_one_canary_per_decode_each_must_answer(autojump_clock: trio.abc.Clock) -> None:  # noqa: ARG001 (requesting it puts the test on trio's clock)
    seen = 0

    def handler(_request: httpx.Request) -> httpx.Response:
        nonlocal seen
        seen += 1
        return httpx.Response(200, content=stream("Hi"))

    latencies = await run_canaries(
        canary(), 3, client=mock_client(handler), log=LOG, router_log=ROUTER_LOG
    )
    assert (seen, len(latencies)) == (3, 3)


async def test_a_canary_that_never_answers_fails_the_job_after_its_budget(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    attempts = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        raise httpx.ConnectError("connection refused", request=request)

    start = trio.current_time()
    with pytest.raises(JobFailed) as failed, trio.fail_after(60):
        await run_canaries(
            canary(timeout_s=10.0),
            1,
            client=mock_client(handler),
            log=LOG,
            router_log=ROUTER_LOG,
        )
    assert str(failed.value) == (
        "the router at http://router:8000 did not serve 1 canary chat requests within 10s "
        "(agent.canary.timeout_s): canary 1: connection refused or failed: connection refused "
        f"(attempt {attempts}); see {ROUTER_LOG}"
    )
    # Retried every CANARY_RETRY_S until the budget was spent, and not much longer.
    assert attempts == pytest.approx(10.0 / CANARY_RETRY_S, abs=2)
    assert 10.0 <= trio.current_time() - start <= 10.0 + 2 * CANARY_RETRY_S
