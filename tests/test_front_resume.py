"""Cut streams continued, the pure parts (agent/front/resume.py, and the watch's quiet cut in
sse.py): which requests may be continued, the continuation's body, and how its chunks are
rewritten into the first stream's; and the stand-ins' side (agent/standins/tokens.py): a
continued answer goes on exactly where the uncut one would. The relay around them:
tests/test_front_plumbing.py; against the real router and SIGKILLed decodes: tests/test_front.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.front import sse
from agent.front.openai import CHAT, COMPLETIONS
from agent.front.resume import Seam, continuation, why_not
from agent.front.sse import DONE, StreamWatch, event_data
from agent.standins import tokens
from agent.standins.decode import _plan
from agent.standins.prefill import _prompt_text
from agent.web.asgi import HTTPError
from tests.kit.front import CUT, ROLE, chunk

HELLO = [{"role": "user", "content": "Hello"}]
REPLY = tokens.FIRST_TOKEN_TEXT + tokens.CONTINUATION_TEXT
SEAM = Seam("chatcmpl-first", 1700000000, "first-model", 5)


def chat(**extra: Any) -> dict[str, Any]:
    """A streamed chat's body."""
    return {"model": "m", "messages": HELLO, "stream": True, **extra}


def data(event: bytes | None) -> Any:
    """An event's JSON payload."""
    assert event is not None
    payload = event_data(event)
    assert payload is not None
    return json.loads(payload)


# ---- which requests ----------------------------------------------------------------------------


def test_a_plain_streamed_chat_may_be_continued() -> None:
    assert why_not(CHAT, chat()) is None
    assert why_not(CHAT, chat(max_tokens=64, temperature=0.7, stop=["\n"])) is None
    assert why_not(CHAT, chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (CHAT, chat(tool_choice="auto"), "tool_choice"),
        (CHAT, chat(response_format={"type": "json_object"}), "response_format"),
        (CHAT, chat(guided_json={"type": "object"}), "guided_json"),
        (CHAT, chat(n=2), "n > 1"),
        (CHAT, chat(logprobs=True), "logprobs"),
        (CHAT, chat(top_logprobs=0), "logprobs"),
        (CHAT, chat(stream=False), "not a streamed chat"),
        (COMPLETIONS, {"prompt": "once", "stream": True}, "not a streamed chat"),
    ],
)
def test_what_cannot_be_continued_is_named(path: str, body: dict[str, Any], why: str) -> None:
    assert why_not(path, body) == why


# ---- the continuation's body -------------------------------------------------------------------


def test_the_continuation_is_the_conversation_plus_the_text_sent_left_open() -> None:
    body = json.loads(continuation(chat(max_tokens=64), "Hello fr", 8) or b"")
    assert body["messages"] == [*HELLO, {"role": "assistant", "content": "Hello fr"}]
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert body["max_tokens"] == 56
    assert body["stream"] is True
    assert body["model"] == "m"


def test_both_budgets_are_reduced_and_no_budget_stays_none() -> None:
    body = json.loads(continuation(chat(max_completion_tokens=10, max_tokens=20), "ab", 2) or b"")
    assert (body["max_completion_tokens"], body["max_tokens"]) == (8, 18)
    body = json.loads(continuation(chat(), "ab", 2) or b"")
    assert "max_tokens" not in body
    assert "max_completion_tokens" not in body


def test_a_spent_budget_is_no_continuation() -> None:
    assert continuation(chat(max_tokens=8), "Hello fr", 8) is None


def test_a_clients_own_open_assistant_turn_is_extended() -> None:
    own = [*HELLO, {"role": "assistant", "content": "Sure: "}]
    value = chat(messages=own, continue_final_message=True, add_generation_prompt=False)
    body = json.loads(continuation(value, "Hel", 3) or b"")
    assert body["messages"] == [*HELLO, {"role": "assistant", "content": "Sure: Hel"}]


# ---- the continuation's chunks -----------------------------------------------------------------


def test_the_continuations_chunks_carry_the_first_streams_identity() -> None:
    other = chunk("llo").replace(b'"id": "chatcmpl-1"', b'"id": "chatcmpl-2", "created": 17')
    got = data(SEAM.rewrite(other))
    assert (got["id"], got["created"], got["model"]) == (SEAM.chunk_id, SEAM.created, SEAM.model)
    assert got["choices"][0]["delta"] == {"content": "llo"}


def test_the_second_role_chunk_is_dropped_its_content_kept() -> None:
    assert SEAM.rewrite(ROLE) is None
    with_role = chunk("x").replace(b'"delta": {', b'"delta": {"role": "assistant", ')
    assert data(SEAM.rewrite(with_role))["choices"][0]["delta"] == {"content": "x"}


def test_the_usage_counts_the_tokens_sent_before() -> None:
    usage = {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
    event = b"data: " + json.dumps({"id": "c2", "choices": [], "usage": usage}).encode() + b"\n\n"
    got = data(SEAM.rewrite(event))
    assert got["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28}
    assert got["id"] == SEAM.chunk_id


def test_done_errors_and_comments_pass_unchanged() -> None:
    for event in (DONE, CUT, b": keep-alive\n\n", b"data: not json\n\n"):
        assert SEAM.rewrite(event) == event


# ---- the first stream's quiet cut ----------------------------------------------------------------


def test_a_quiet_cut_says_nothing_until_asked_and_keeps_the_text_sent() -> None:
    watch = StreamWatch(keep_text=True, quiet_cut=True)
    out = [
        o
        for e in [ROLE, chunk("H"), chunk("e"), chunk(None, "stop"), CUT, DONE]
        for o in watch.push(e)
    ]
    assert out == [ROLE, chunk("H"), chunk("e")]
    assert watch.truncated is not None
    assert (watch.text, watch.chunks, watch.plain) == ("He", 2, True)
    last = watch.cut_events(before=3)
    assert last[-1] == DONE
    error = data(last[0])["error"]
    assert (error["type"], error["chunks"]) == ("stream_truncated", 5)


def test_a_held_finish_chunks_own_text_is_not_counted_sent_when_cut() -> None:
    watch = StreamWatch(keep_text=True, quiet_cut=True)
    for event in [chunk("H"), chunk("e", "stop"), CUT]:
        watch.push(event)
    assert (watch.text, watch.chunks) == ("H", 1)


def test_a_stream_that_carried_more_than_text_is_not_plain() -> None:
    watch = StreamWatch(keep_text=True, quiet_cut=True)
    thought = chunk("x").replace(b'"content": "x"', b'"reasoning_content": "hm"')
    for event in [chunk("H"), thought, CUT]:
        watch.push(event)
    assert not watch.plain


def test_a_kept_streams_tokens_are_not_parsed_until_its_text_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With resume on the per-event path is the byte scan: only the role chunk is parsed as the
    tokens pass; a cut that asks for the text decodes the kept bytes."""
    decoded: list[bytes] = []
    real = sse._decoded

    def counted(data: bytes) -> dict[str, Any] | None:
        decoded.append(data)
        return real(data)

    monkeypatch.setattr(sse, "_decoded", counted)
    watch = StreamWatch(keep_text=True, quiet_cut=True)
    for event in [ROLE, *(chunk(c) for c in "Hello"), CUT]:
        watch.push(event)
    assert len(decoded) == 2  # the role chunk, the cut's error chunk
    assert (watch.text, watch.chunks, watch.plain) == ("Hello", 5, True)


def test_a_token_with_tool_calls_beside_its_text_makes_the_stream_not_plain() -> None:
    """A chunk the byte scan passes (it has text) is still read for more than text at the cut."""
    watch = StreamWatch(keep_text=True, quiet_cut=True)
    call = chunk("x").replace(b'"content": "x"', b'"content": "x", "tool_calls": [{"index": 0}]')
    for event in [ROLE, chunk("H"), call, CUT]:
        watch.push(event)
    assert (watch.text, watch.chunks) == ("Hx", 2)
    assert not watch.plain


# ---- the stand-ins honour it -------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 1, 8, len(REPLY) - 1, len(REPLY)])
def test_the_stand_ins_continue_an_open_assistant_turn_where_it_was_cut(cut: int) -> None:
    """The prompt vLLM renders for the front's continuation holds the reply so far; the prefill's
    first token and the decode's rest (both from ``reply_at``) are exactly the uncut reply's."""
    messages = [*HELLO, {"role": "assistant", "content": REPLY[:cut]}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    at = tokens.reply_at(_prompt_text(body, is_chat=True))
    assert at == cut
    first = tokens.reply_ids(at, 1)[0]
    ids, finish = _plan(first, 64, ignore_eos=False, at=at)
    assert REPLY[:cut] + tokens.render(ids) == REPLY
    assert (ids[-1], finish) == (tokens.EOS_ID, "stop")


def test_a_plain_chat_and_text_the_model_did_not_write_start_the_reply() -> None:
    assert tokens.reply_at(_prompt_text({"messages": HELLO}, is_chat=True)) == 0
    other = [*HELLO, {"role": "assistant", "content": "Sure: "}]
    body = {"messages": other, "continue_final_message": True, "add_generation_prompt": False}
    assert tokens.reply_at(_prompt_text(body, is_chat=True)) == 0


def test_with_ignore_eos_the_continued_reply_repeats_as_the_uncut_one() -> None:
    whole = tokens.reply_ids(0, 100, ignore_eos=True)
    text = tokens.render(whole)
    at = tokens.reply_at(tokens.ASSISTANT_TURN + text[:60])
    assert at == 60
    assert tokens.reply_ids(at, 40, ignore_eos=True) == whole[60:]


def test_the_prefill_refuses_an_open_turn_with_a_generation_prompt_as_vllm_does() -> None:
    body = {"messages": HELLO, "continue_final_message": True}
    with pytest.raises(HTTPError, match="Cannot set both"):
        _prompt_text(body, is_chat=True)
