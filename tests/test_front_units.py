"""The front door's pure parts: which failures are tried again, how a proxied stream is passed on
and marked when cut, and what TileRT 0.1.6 cannot serve (agent/front/retry.py, sse.py, openai.py).

The events (tests/kit/front.py) are the real router's (tilert 0.1.6.post3), as tests/test_front.py
sees them: a decode that dies mid-stream ends with a ``stop`` chunk, ``data: {"error": ...}``,
``[DONE]``. The plumbing around them (the proxy, the relay): tests/test_front_plumbing.py.
"""

from __future__ import annotations

import json

import pytest

from agent.front import sse
from agent.front.openai import models_body, unsupported, upstream_error, wants_usage
from agent.front.retry import (
    BACKOFF_MAX_S,
    BUSY_DELAY_S,
    REFUSED_DELAY_S,
    RetryBudget,
    connect_failure,
    retriable,
    status_failure,
    stream_failure,
)
from agent.front.sse import DONE, EventSplitter, StreamWatch, event_data, plain_content
from tests.kit.front import CUT, ROLE, USAGE, chunk


def run(watch: StreamWatch, events: list[bytes], *, end: bool = True) -> list[bytes]:
    """What the client gets for ``events`` (then the upstream's end)."""
    out = [o for e in events for o in watch.push(e)]
    return out + (watch.end() if end else [])


def error_of(event: bytes) -> dict[str, object]:
    """The ``error`` object of an error event."""
    data = event_data(event)
    assert data is not None
    error = json.loads(data)["error"]
    assert isinstance(error, dict)
    return error


# ---- retry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (connect_failure("refused"), True),
        (status_failure(502, "decode call failed"), True),
        (status_failure(503, "x"), True),
        (status_failure(504, "x"), True),
        (status_failure(429, '{"error": "all decode nodes busy"}'), True),
        (stream_failure("cut before the first token"), True),
        (status_failure(400, "prompt too long"), False),
        (status_failure(404, "no route"), False),
        (status_failure(501, "capability_unavailable"), False),
        (status_failure(500, "internal"), False),
    ],
)
def test_which_failures_are_tried_again(failure: object, expected: bool) -> None:
    assert retriable(failure) is expected  # type: ignore[arg-type]


def test_busy_waits_at_the_routers_pace_and_others_double_up_to_the_cap() -> None:
    budget = RetryBudget(attempts=10, budget_s=600)
    assert budget.next_delay(status_failure(429, "busy"), 1, 0.0) == BUSY_DELAY_S
    delays = [budget.next_delay(connect_failure("x"), n, 0.0) for n in range(1, 8)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert max(d for d in delays if d is not None) == BACKOFF_MAX_S


def test_the_budget_bounds_tries_and_seconds() -> None:
    budget = RetryBudget(attempts=3, budget_s=10)
    failure = status_failure(502, "x")
    assert budget.next_delay(failure, 2, 0.0) is not None
    assert budget.next_delay(failure, 3, 0.0) is None  # the third try was the last
    assert budget.next_delay(failure, 1, 9.9) is None  # the pause would pass the budget
    assert budget.next_delay(status_failure(400, "x"), 1, 0.0) is None


# ---- sse -----------------------------------------------------------------------------------


def test_events_are_split_on_blank_lines_across_reads() -> None:
    splitter = EventSplitter()
    whole = chunk("a") + chunk("b")
    assert splitter.feed(whole[:10]) == []
    assert splitter.feed(whole[10:]) == [chunk("a"), chunk("b")]
    assert splitter.feed(b"data: x\r\n\r\n") == [b"data: x\n\n"]
    assert splitter.rest() == b""


def test_a_whole_stream_passes_unchanged_the_finish_held_until_done() -> None:
    watch = StreamWatch()
    assert watch.push(ROLE) == [ROLE]
    assert watch.push(chunk("Hel")) == [chunk("Hel")]
    assert watch.push(chunk(None, "stop")) == []  # held: the next event says if it was a cut
    assert watch.push(DONE) == [chunk(None, "stop"), DONE]
    assert watch.end() == []
    assert watch.truncated is None
    assert watch.chunks == 1


def test_usage_after_the_finish_releases_it() -> None:
    watch = StreamWatch(want_usage=True)
    out = run(watch, [chunk("a"), chunk(None, "length"), USAGE, DONE])
    assert out == [chunk("a"), chunk(None, "length"), USAGE, DONE]


def test_the_routers_cut_becomes_the_truncated_error_never_a_stop() -> None:
    """Stop chunk, error, [DONE] (a decode died): the stop is dropped, the error is ours."""
    watch = StreamWatch()
    out = run(watch, [ROLE, chunk("H"), chunk("e"), chunk(None, "stop"), CUT, DONE])
    assert out[:3] == [ROLE, chunk("H"), chunk("e")]
    assert len(out) == 5
    assert out[4] == DONE
    error = error_of(out[3])
    assert error["type"] == "stream_truncated"
    assert error["chunks"] == 2
    assert error["upstream"] == {
        "error": "stream failed: peer closed",
        "error_type": "decode_stream_failed",
    }
    assert watch.truncated is not None
    assert not any(b'"finish_reason": "stop"' in e for e in out)


def test_an_untyped_decode_error_in_the_text_is_a_cut() -> None:
    text = chunk("\n[decode error: decode stalled]")
    out = run(StreamWatch(), [chunk("a"), text, chunk(None, "stop"), DONE])
    assert out[0] == chunk("a")
    assert error_of(out[1])["type"] == "stream_truncated"
    assert out[2:] == [DONE]


@pytest.mark.parametrize(
    ("events", "why"),
    [
        ([chunk("a")], "without a finish reason"),  # the router died mid-stream
        ([chunk("a"), chunk(None, "stop")], "without [DONE]"),
        ([chunk("a"), DONE], "without a finish reason"),
    ],
)
def test_a_stream_that_ends_early_is_a_cut(events: list[bytes], why: str) -> None:
    watch = StreamWatch()
    out = run(watch, events)
    assert out[-1] == DONE
    assert error_of(out[-2])["type"] == "stream_truncated"
    assert watch.truncated is not None
    assert why in watch.truncated


@pytest.mark.parametrize(
    ("event", "plain"),
    [
        (chunk("Hel"), True),
        (b"data: " + chunk("Hel")[6:].replace(b": ", b":").replace(b", ", b","), True),  # compact
        (chunk('say "finish_reason": "stop", "error": 1'), True),  # quoted in text: escaped
        (chunk("[DONE]"), False),  # a marker in the text: parsed (the parse decides)
        (chunk(""), False),
        (chunk(None), False),
        (chunk(None, "stop"), False),
        (chunk("a", "length"), False),
        (chunk("\n[decode error: decode stalled]"), False),
        (ROLE, False),
        (CUT, False),
        (USAGE, False),
        (DONE, False),
        (b": keep-alive\n\n", False),
        (b"data: " + chunk("a")[6:-2] + b"\ndata: " + chunk("b")[6:], False),  # two data lines
    ],
)
def test_only_plain_tokens_pass_unparsed(event: bytes, plain: bool) -> None:
    """The byte scan says plain only of a chunk the parse would pass on as a token."""
    assert plain_content(event) is plain
    if plain:
        data = json.loads(event_data(event) or b"")
        choice = data["choices"][0]
        assert choice["finish_reason"] is None
        assert choice["delta"]["content"]


@pytest.mark.parametrize("keep_text", [False, True])
def test_the_byte_scan_and_the_parse_agree_on_a_stream(
    monkeypatch: pytest.MonkeyPatch, keep_text: bool
) -> None:
    """Tokens after the role chunk pass unparsed; the stream's state (and its kept text) is the
    parse's."""
    events = [ROLE, chunk("a"), chunk("b"), chunk(None, "stop"), USAGE, DONE]
    fast = StreamWatch(want_usage=True, keep_text=keep_text)
    fast_out = run(fast, events)
    monkeypatch.setattr(sse, "plain_content", lambda _event: False)  # every event parsed
    parsed = StreamWatch(want_usage=True, keep_text=keep_text)
    assert fast_out == run(parsed, events)
    names = ("chunks", "events", "finish", "done", "truncated", "usage_seen", "chunk_id", "text")
    for name in (*names, "plain"):
        assert getattr(fast, name) == getattr(parsed, name), name


def test_usage_is_counted_when_the_router_sends_none() -> None:
    watch = StreamWatch(want_usage=True)
    out = run(watch, [chunk("a"), chunk("b"), chunk(None, "stop"), DONE])
    usage = json.loads(event_data(out[-2]) or b"")
    assert usage["usage"]["completion_tokens"] == 2
    assert usage["choices"] == []


def test_comments_and_unparsed_events_pass() -> None:
    watch = StreamWatch()
    assert watch.push(b": keep-alive\n\n") == [b": keep-alive\n\n"]
    assert watch.push(b"data: not json\n\n") == [b"data: not json\n\n"]


# ---- openai ----------------------------------------------------------------------------------


def test_models_is_openais_list() -> None:
    body = models_body("glm-5", 7)
    assert body == {
        "object": "list",
        "data": [{"id": "glm-5", "object": "model", "created": 7, "owned_by": "tilert-agent"}],
    }


@pytest.mark.parametrize(
    ("path", "body", "word"),
    [
        ("/v1/chat/completions", {"n": 2}, "n=2"),
        ("/v1/completions", {"best_of": 3}, "best_of=3"),
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"stream": True}, "stream"),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
    ],
)
def test_what_tilert_cannot_serve_is_named(path: str, body: dict[str, object], word: str) -> None:
    why = unsupported(path, body)
    assert why is not None
    assert word in why


@pytest.mark.parametrize(
    "body", [{"n": 1}, {"stream": True, "logprobs": True, "top_logprobs": 2}, {"best_of": 1}]
)
def test_what_it_serves_passes(body: dict[str, object]) -> None:
    assert unsupported("/v1/chat/completions", body) is None


def test_usage_asked_and_router_errors_in_openais_shape() -> None:
    assert wants_usage({"stream_options": {"include_usage": True}})
    assert not wants_usage({"stream_options": "yes"})
    error = upstream_error(429, b'{"error": "all decode nodes busy"}')
    assert error == {
        "error": {"message": "all decode nodes busy", "type": "upstream_error", "code": 429}
    }
    typed = upstream_error(400, b'{"error": "bad", "error_type": "invalid_parameter"}')
    assert typed["error"]["type"] == "invalid_parameter"
    assert upstream_error(502, b"oops")["error"]["message"] == "oops"


def test_a_refused_connection_is_no_try_but_the_seconds_still_bound_it() -> None:
    """Nothing listens (the router died; the head restarts it): tried again at a steady pace,
    past the attempts, until the budget's seconds are spent."""
    budget = RetryBudget(attempts=2, budget_s=10)
    refused = connect_failure("refused", refused=True)
    assert refused.reason == "refused"
    assert budget.next_delay(refused, 2, 0.0) == REFUSED_DELAY_S
    assert budget.next_delay(refused, 2, 9.9) is None
    assert budget.next_delay(connect_failure("reset"), 2, 0.0) is None
