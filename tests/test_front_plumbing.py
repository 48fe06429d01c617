"""The front door's plumbing in process (agent/front/app.py, proxy.py, ticket.py) with the kit of
tests/kit/front.py: the router on an ``httpx.MockTransport``, its state scripted, trio's autojump
clock. Retries and their budget, the wait through a hand-over, a cut stream marked, bad bodies, a
client that leaves mid-stream, and every error the front says in OpenAI's shape. The same paths
against the real router: tests/test_front.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from agent.front.openai import CHAT
from agent.front.resume import MAX_RESUMES
from agent.front.sse import DONE
from tests.kit.front import (
    CUT,
    ROLE,
    ROUTER_A,
    ROUTER_B,
    USAGE,
    Client,
    FrontKit,
    chat_body,
    chunk,
    events,
    full_reply,
    refused,
    status,
    whole,
)

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0}]}


def served(kit: FrontKit, url: str = ROUTER_A) -> FrontKit:
    kit.router.serving(url)
    return kit


# ---- retries and their budget ----------------------------------------------------------------


async def test_a_reply_at_the_first_try_passes_as_the_router_gave_it(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(whole(ANSWER))
    async with kit.front.connected():
        got = await kit.chat()
    assert (got.status, got.json()) == (200, ANSWER)
    assert [str(r.url) for r in kit.upstream.seen] == [ROUTER_A + CHAT]
    assert kit.upstream.seen[0].content == chat_body()
    assert kit.outcomes() == {"ok": 1}
    assert (kit.figures.in_flight, kit.front.admission.admitted) == (0, 0)


async def test_failures_before_the_first_byte_are_tried_again(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(status(502, "decode call failed"), refused(), status(429), whole(ANSWER))
    async with kit.front.connected():
        got = await kit.chat()
    assert got.status == 200
    assert len(kit.upstream.seen) == 4
    assert dict(kit.figures.retry_tally) == {"status_502": 1, "refused": 1, "busy": 1}
    assert kit.outcomes() == {"retried_ok": 1}


async def test_out_of_attempts_the_last_failure_is_answered_in_openais_shape(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit(attempts=3))
    kit.upstream.script(status(502, "decode call failed"))
    async with kit.front.connected():
        got = await kit.chat()
    assert len(kit.upstream.seen) == 3
    error = got.error()
    assert (got.status, error["type"]) == (502, "upstream_failed")
    assert "in 3 tries: decode call failed" in error["message"]
    assert got.headers["retry-after"] == "2"
    assert kit.outcomes() == {"failed": 1}


async def test_the_budgets_seconds_bound_the_tries(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """A busy router (429) is tried again every 0.5 s, never past the budget's 2 s."""
    kit = served(FrontKit(attempts=100, budget_s=2.0))
    kit.upstream.script(status(429, '{"error": "all decode nodes busy"}'))
    start = trio.current_time()
    async with kit.front.connected():
        got = await kit.chat()
    assert trio.current_time() - start <= 2.0
    assert 2 <= len(kit.upstream.seen) <= 4
    assert (got.status, got.error()["type"]) == (503, "upstream_failed")


@pytest.mark.parametrize(
    ("answer", "code", "kind"),
    [
        (status(400, '{"error": "prompt too long", "error_type": "invalid_request"}'), 400, None),
        (status(501, '{"error": "seed is not supported"}'), 400, "unsupported"),
        (status(500, "internal"), 502, "upstream_failed"),
    ],
    ids=["4xx", "501", "500"],
)
async def test_what_trying_again_cannot_help_is_tried_once(
    answer: object,
    code: int,
    kind: str | None,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(answer)  # type: ignore[arg-type]
    async with kit.front.connected():
        got = await kit.chat()
    assert len(kit.upstream.seen) == 1
    assert got.status == code
    assert got.json()["error"]["type"] == (kind or "invalid_request")


# ---- the router's state: none, handing over, serving -----------------------------------------


async def test_a_request_waits_through_a_hand_over_and_goes_to_the_new_router(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """none -> handing over -> serving at a new address: a request before the router gets 503
    at once; one during the hand-over waits for it (no try) and goes to the new router."""
    kit = FrontKit()
    kit.upstream.script(whole(ANSWER))
    got: dict[str, object] = {}

    async def at(when: float, name: str) -> None:
        await trio.sleep(when)
        got[name] = await kit.chat()
        got[name + "_at"] = trio.current_time() - start

    start = trio.current_time()
    async with kit.front.connected(), trio.open_nursery() as nursery:
        nursery.start_soon(at, 0.5, "before")
        nursery.start_soon(at, 2.0, "during")
        steps = [(1.0, kit.router.handing_over), (5.0, lambda: kit.router.serving(ROUTER_B))]
        nursery.start_soon(kit.router.play, steps)
    before, during = got["before"], got["during"]
    assert (before.status, before.error()["type"]) == (503, "unavailable")  # type: ignore[attr-defined]
    assert before.headers["retry-after"] == "2"  # type: ignore[attr-defined]
    assert during.status == 200  # type: ignore[attr-defined]
    assert got["during_at"] >= 5.0  # type: ignore[operator]
    assert [str(r.url) for r in kit.upstream.seen] == [ROUTER_B + CHAT]
    assert kit.outcomes() == {"rejected": 1, "ok": 1}  # the wait was no try


async def test_a_hand_over_longer_than_the_budget_is_503(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = FrontKit(budget_s=5.0)
    kit.router.handing_over()
    async with kit.front.connected():
        got = await kit.chat()
    assert (got.status, got.error()["type"]) == (503, "unavailable")
    assert "did not come back within the budget" in got.error()["message"]
    assert kit.upstream.seen == []
    assert kit.front.admission.admitted == 0


async def test_after_a_failure_the_next_try_waits_for_the_pool_to_be_whole(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = FrontKit()
    kit.router.serving(settling="decode-1 is restarting")
    kit.upstream.script(status(502, "decode call failed"), whole(ANSWER))
    start = trio.current_time()
    async with kit.front.connected(), trio.open_nursery() as nursery:
        nursery.start_soon(kit.router.play, [(30.0, kit.router.serving)])
        got = await kit.chat()
    assert got.status == 200
    assert trio.current_time() - start >= 30.0
    assert len(kit.upstream.seen) == 2


# ---- streams ---------------------------------------------------------------------------------


async def test_a_stream_passes_whole_and_its_slot_is_given_back(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(events(*full_reply("Hel", "lo")))
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    assert got.events() == full_reply("Hel", "lo")
    assert kit.outcomes() == {"ok": 1}
    assert kit.upstream.streams[0].closed
    assert kit.front.admission.admitted == 0


async def test_a_stream_cut_by_the_router_is_marked_truncated_never_a_stop(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit(resume=False))
    kit.upstream.script(events(ROLE, chunk("H"), chunk("e"), chunk(None, "stop"), CUT, DONE))
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    sent = got.events()
    assert sent[:3] == [ROLE, chunk("H"), chunk("e")]
    assert sent[-1] == DONE
    assert b'"type":"stream_truncated"' in sent[-2]
    assert not any(b'"finish_reason": "stop"' in e for e in sent)
    assert kit.outcomes() == {"truncated": 1}
    assert kit.front.admission.admitted == 0


async def test_a_stream_whose_connection_breaks_is_marked_truncated(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit(resume=False))
    kit.upstream.script(events(ROLE, chunk("H"), then="break"))
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    assert b"without a finish reason" in got.events()[-2]
    assert kit.outcomes() == {"truncated": 1}


def other(event: bytes) -> bytes:
    """``event`` as a continuation's stream sends it: an id of its own."""
    return event.replace(b"chatcmpl-1", b"chatcmpl-2")


def payloads(sent: list[bytes]) -> list[object]:
    """The events' payloads (JSON decoded; ``[DONE]`` as it is)."""
    return [e if e == DONE else json.loads(e[6:]) for e in sent]


async def test_a_cut_stream_is_continued_and_the_client_sees_one_stream(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    cut = events(ROLE, chunk("H"), chunk("e"), chunk(None, "stop"), CUT, DONE)
    usage = USAGE.replace(b'"completion_tokens": 2', b'"completion_tokens": 3')
    rest = events(*map(other, [ROLE, chunk("llo"), chunk(None, "stop"), usage, DONE]))
    kit.upstream.script(cut, rest)
    include = {"include_usage": True}
    async with kit.front.connected():
        got = await kit.chat(stream=True, max_tokens=10, stream_options=include)
    whole = [ROLE, chunk("H"), chunk("e"), chunk("llo"), chunk(None, "stop")]
    summed = USAGE.replace(b'"completion_tokens": 2', b'"completion_tokens": 5')
    assert payloads(got.events()) == payloads([*whole, summed, DONE])
    sent = json.loads(kit.upstream.seen[1].content)
    assert sent["messages"][-1] == {"role": "assistant", "content": "He"}
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
    assert sent["max_tokens"] == 8
    assert kit.outcomes() == {"resumed": 1}
    assert all(s.closed for s in kit.upstream.streams)
    assert kit.front.admission.admitted == 0


async def test_a_continuation_is_tried_again_before_its_first_byte(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    cut = events(ROLE, chunk("H"), then="break")
    rest = events(*map(other, full_reply("i")))
    kit.upstream.script(cut, status(502, "All connection attempts failed"), rest)
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    assert payloads(got.events()) == payloads([ROLE, chunk("H"), chunk("i"), *full_reply()[1:]])
    assert dict(kit.figures.retry_tally) == {"status_502": 1}
    assert kit.outcomes() == {"resumed": 1}


async def test_continuations_are_bounded_then_the_cut_is_marked(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(events(ROLE, chunk("H"), chunk("e"), CUT, DONE))  # every time
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    sent = got.events()
    assert len(kit.upstream.seen) == 1 + MAX_RESUMES
    assert sent.count(ROLE) == 1
    assert sent[-1] == DONE
    error = json.loads(sent[-2][6:])["error"]
    assert (error["type"], error["chunks"]) == ("stream_truncated", 2 * (1 + MAX_RESUMES))
    assert kit.outcomes() == {"truncated": 1}


@pytest.mark.parametrize(
    ("extra", "first"),
    [
        ({"logprobs": True}, chunk("H")),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, chunk("H")),
        ({}, chunk("H").replace(b'"content"', b'"reasoning_content"')),
    ],
    ids=["logprobs", "tools", "reasoning-streamed"],
)
async def test_what_cannot_be_continued_is_marked_as_before(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    extra: dict[str, Any],
    first: bytes,
) -> None:
    kit = served(FrontKit())
    kit.upstream.script(events(ROLE, first, chunk("e"), CUT, DONE), events(*full_reply("x")))
    async with kit.front.connected():
        got = await kit.chat(stream=True, **extra)
    assert b'"type":"stream_truncated"' in got.events()[-2]
    assert len(kit.upstream.seen) == 1
    assert kit.outcomes() == {"truncated": 1}


async def test_a_stream_that_fails_before_its_first_token_is_tried_again(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """The role chunk is held until the first content: the failed try's never reaches the
    client, which gets one whole reply."""
    kit = served(FrontKit())
    kit.upstream.script(events(ROLE, CUT, DONE), events(*full_reply("Hi")))
    async with kit.front.connected():
        got = await kit.chat(stream=True)
    assert got.events() == full_reply("Hi")
    assert dict(kit.figures.retry_tally) == {"stream_error": 1}
    assert kit.outcomes() == {"retried_ok": 1}


@pytest.mark.parametrize(
    ("client", "sent"),
    [
        (Client((chat_body(stream=True),), leave_after=1), [ROLE, chunk("H")]),
        # Cancelled while its start is sent, the relay (an async generator) never runs, nor its
        # ``finally``: the response's ``closed`` hook gives back what it holds.
        (Client((chat_body(stream=True),), stopped_at_start=True), []),
    ],
    ids=["leaves-mid-stream", "stopped-before-its-first-chunk"],
)
async def test_a_stream_that_ends_early_closes_the_routers_stream_and_frees_its_slot(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    client: Client,
    sent: list[bytes],
) -> None:
    kit = served(FrontKit(capacity=1))
    kit.upstream.script(events(ROLE, chunk("H"), then="hang"), whole(ANSWER))
    async with kit.front.connected():
        first = await kit.call("POST", CHAT, client)
        assert (first.status, first.events()) == (200, sent)
        assert kit.upstream.streams[0].closed
        assert (kit.front.admission.admitted, kit.figures.in_flight) == (0, 0)
        assert kit.outcomes() == {"cancelled": 1}
        with trio.fail_after(1.0):  # the one slot is free: no wait in the queue
            second = await kit.chat()
    assert second.status == 200


async def test_a_client_that_leaves_on_reading_done_was_served(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    # The relay is the service front's too (agent/front/relay.py): a client that closes the
    # moment it read [DONE], before the response's own end, got the whole stream.
    kit = served(FrontKit())
    kit.upstream.script(events(*full_reply("Hel", "lo")))
    async with kit.front.connected():
        got = await kit.call("POST", CHAT, Client((chat_body(stream=True),), leave_on=b"[DONE]"))
    assert got.events() == full_reply("Hel", "lo")
    assert kit.outcomes() == {"ok": 1}


# ---- bad bodies and every error in OpenAI's shape --------------------------------------------


@pytest.mark.parametrize(
    ("client", "headers", "code", "kind"),
    [
        (Client((b"{not json",)), (), 400, "invalid_request"),
        (Client((b"[1, 2]",)), (), 400, "invalid_request"),
        (Client((chat_body(n=2),)), (), 400, "unsupported"),
        (Client((b"{}",)), ((b"content-length", b"9999999"),), 413, "request_too_large"),
        (Client((b"{" + b" " * 4096, b" " * (1 << 20))), (), 413, "request_too_large"),
        (Client((b"{",), stall=True), (), 408, "timeout"),
    ],
    ids=["not-json", "not-an-object", "n=2", "declared-too-big", "too-big", "slow"],
)
async def test_a_bad_body_is_refused_before_the_router(
    client: Client,
    headers: tuple[tuple[bytes, bytes], ...],
    code: int,
    kind: str,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    kit = served(FrontKit())
    async with kit.front.connected():
        got = await kit.call("POST", CHAT, client, headers)
    assert (got.status, got.error()["type"]) == (code, kind)
    assert kit.upstream.seen == []
    assert kit.outcomes() == {"rejected": 1}


async def test_every_error_the_front_says_is_in_openais_shape(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """A wrong path or method, an endpoint TileRT has no engine for, a full queue, no router,
    a router that fails, and a front that fails itself: each an OpenAI error object."""
    kit = FrontKit(capacity=0, max_waiting=0, attempts=2)
    async with kit.front.connected():
        answers = {
            "no-route": await kit.call("GET", "/v2/nothing"),
            "method": await kit.call("GET", CHAT),
            "no-engine": await kit.call("POST", "/v1/embeddings"),
            "no-router": await kit.chat(),
        }
        kit.router.serving()
        answers["queue-full"] = await kit.chat()
        kit.capacity = 1
        kit.upstream.script(status(503, "no decode"))
        answers["router-fails"] = await kit.chat()
        kit.router.failure = RuntimeError("a bug in the head")
        answers["front-fails"] = await kit.call("GET", "/health")
    codes = {name: (got.status, got.error()["type"]) for name, got in answers.items()}
    assert codes == {
        "no-route": (404, "not_found"),
        "method": (405, "method_not_allowed"),
        "no-engine": (404, "unsupported"),
        "no-router": (503, "unavailable"),
        "queue-full": (429, "rate_limit_exceeded"),
        "router-fails": (503, "upstream_failed"),
        "front-fails": (500, "server_error"),
    }
