"""Cut streams continued (recipe ``agent.front.resume``): a stream whose decode died after its
first byte is finished by a new request, and the client sees one uninterrupted stream.

TileRT's router passes a chat's body to the prefill unchanged (``build_prefill_body``), so the
conversation plus the text already sent, as an assistant message with
``continue_final_message: true`` and ``add_generation_prompt: false``, continues the answer where
it was cut with no change to TileRT (0.1.6.post3 sends such a chat down its chat path: vLLM
renders the open assistant turn). The continuation goes the way of any request
(``agent.front.relay.Relay``: tries before its first byte, waits through a hand-over; at the
service front, to another cell) in the request's own admission slot, its ``max_tokens`` (or
``max_completion_tokens``) less the tokens already sent; its chunks are rewritten to the first
stream's ``id``, ``created`` and ``model``, its role chunk dropped and its usage summed
(``Seam``). At most ``MAX_RESUMES`` per request; then, or when the continuation is refused, the
cut is marked as without resume (``stream_truncated``).

Only plain chats are continued (``why_not``): not with tools, ``response_format`` or a grammar,
``n > 1``, logprobs; nor a stream whose chunks carried more than text (reasoning, tool calls):
what was sent could not be given back to the model as it was. ``/v1/completions`` is not
continued: the front refuses to stream it (TileRT 0.1.6 streams chats only), and a whole reply is
never cut after its first byte (it is tried again instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from agent.front.openai import CHAT
from agent.front.sse import StreamWatch, event_data

MAX_RESUMES = 3  # continuations per request; a fourth cut is marked
# Request keys with which the text sent so far is not all the model would need to go on.
NOT_PLAIN = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",  # TileRT's router reads these two as a decode grammar too
    "ebnf",
)
TOKEN_KEYS = ("max_completion_tokens", "max_tokens")


def why_not(path: str, value: dict[str, Any]) -> str | None:
    """Why a request's stream cannot be continued after a cut (None: it can)."""
    if path != CHAT or not value.get("stream"):
        return "not a streamed chat"
    if not isinstance(value.get("messages"), list):
        return "no messages"
    for key in NOT_PLAIN:
        if value.get(key):
            return key
    form = value.get("response_format")
    if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
        return "response_format"
    n = value.get("n")
    if isinstance(n, int) and n > 1:
        return "n > 1"
    if value.get("logprobs") or value.get("top_logprobs") is not None:
        return "logprobs"
    return None


def continuation(value: dict[str, Any], text: str, sent: int) -> bytes | None:
    """The request that continues ``value``'s answer after ``text`` (``sent`` tokens); None when
    its token budget is spent."""
    messages = list(value["messages"])
    last = messages[-1] if messages else None
    own = (
        value.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    )
    if own and isinstance(last, dict):  # the client's own open assistant turn: extended
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    body = {**value, "messages": messages}
    body.update(continue_final_message=True, add_generation_prompt=False)
    for key in TOKEN_KEYS:
        budget = value.get(key)
        if isinstance(budget, int) and not isinstance(budget, bool):
            if budget - sent < 1:
                return None
            body[key] = budget - sent
    return msgspec.json.encode(body)


@dataclass(frozen=True)
class Seam:
    """What a continuation's chunks are rewritten to: the first stream's identity, and the
    tokens sent before it (added to its usage)."""

    chunk_id: str
    created: int
    model: str
    sent: int

    def rewrite(self, event: bytes) -> bytes | None:
        """One continuation event as the client gets it (None: dropped, a second role chunk)."""
        data = event_data(event)
        if data is None or data.strip() == b"[DONE]":
            return event
        try:
            chunk = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return event
        if not isinstance(chunk, dict) or "error" in chunk:
            return event
        for key, first in (("id", self.chunk_id), ("created", self.created), ("model", self.model)):
            if key in chunk and first:
                chunk[key] = first
        choices = chunk.get("choices") or []
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
        if choices and all(_says_nothing(c) for c in choices) and "usage" not in chunk:
            return None
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            _add_sent(usage, self.sent)
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _says_nothing(choice: Any) -> bool:
    """A choice with an empty delta (what is left of a role chunk), no finish, no logprobs."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    empty = isinstance(delta, dict) and not any(v for v in delta.values())
    return empty and not choice.get("finish_reason") and not choice.get("logprobs")


def _add_sent(usage: dict[str, Any], sent: int) -> None:
    """The continuation's usage as the whole answer's: its completion plus the tokens sent
    before it (its prompt already holds them as the assistant's text)."""
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        usage["completion_tokens"] = completion + sent
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            usage["total_tokens"] = prompt + completion + sent


@dataclass
class ContinuedWatch(StreamWatch):
    """A continuation's stream: watched as any, its events rewritten by ``seam``."""

    seam: Seam = field(default_factory=lambda: Seam("", 0, "", 0))

    def push(self, event: bytes) -> list[bytes]:
        """One event from the router -> what the client gets now, rewritten."""
        return [out for e in super().push(event) if (out := self.seam.rewrite(e)) is not None]


@dataclass
class Resume:
    """One streamed chat's continuations, as ``agent.front.relay.Relay`` makes them: the text
    and tokens sent so far, the stream read now, at most ``MAX_RESUMES``."""

    path: str
    value: dict[str, Any]
    want_usage: bool
    text: str = ""  # the answer's text sent before the last stream
    sent: int = 0  # its tokens (content chunks)
    count: int = 0  # continuations that reached the client
    last: StreamWatch | None = None  # the stream read now (its end is the answer's)
    marked: bool = False  # given up: the cut was marked (``stream_truncated``)
    seam: Seam = field(default_factory=lambda: Seam("", 0, "", 0))

    def first_watch(self) -> StreamWatch:
        """The first stream's watch: its text kept, a cut left to the relay."""
        return StreamWatch(want_usage=self.want_usage, keep_text=True, quiet_cut=True)

    def next_watch(self) -> StreamWatch:
        """A continuation's watch: its events rewritten into the first stream's (``seam``)."""
        return ContinuedWatch(
            want_usage=self.want_usage, keep_text=True, quiet_cut=True, seam=self.seam
        )

    def begin(self, cut: StreamWatch) -> None:
        """The first stream (``cut``) was cut: its identity is the answer's."""
        self.last = cut
        self.seam = Seam(cut.chunk_id, cut.created, cut.model, 0)

    def next_body(self, watch: StreamWatch) -> bytes | None:
        """After ``watch`` was cut: the next continuation's body, or None (not plain, too many,
        no budget left)."""
        self.text += watch.text
        self.sent += watch.chunks
        if not watch.plain or self.count >= MAX_RESUMES:
            return None
        self.seam = Seam(self.seam.chunk_id, self.seam.created, self.seam.model, self.sent)
        return continuation(self.value, self.text, self.sent)

    def opened(self, watch: StreamWatch) -> None:
        """A continuation began (its first content reached us): ``watch`` is read now."""
        self.count += 1
        self.last = watch
