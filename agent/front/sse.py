"""A proxied OpenAI stream, event by event: what to pass on, and how it ended.

Each server-sent event is passed on as soon as its blank line arrives, except the one chunk that
carries a ``finish_reason``: it is held until the next event says whether the stream really ended
(a usage chunk or ``[DONE]``: passed on) or was cut. TileRT 0.1.6's router ends a stream whose
decode died with a normal ``stop`` chunk, then ``data: {"error": ...}``, then ``[DONE]``; a
decode's untyped error becomes the text ``\\n[decode error: ...]`` before that ``stop``. The
front turns both, and a stream that ends without ``[DONE]`` or without a finish reason, into the
contract's ``stream_truncated`` error event, so no cut reads as an answer (docs/reliability.md).

``StreamReader`` is the one reader of TileRT's event stream: the front's proxy reads a stream up to
its first content with it, the relay reads the rest, and the head's canaries read their replies
with it, so a reply the front would mark cut (an error chunk, a decode error in the text) is a
failed canary too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"
# The text TileRT's router puts in the reply when the decode sent an untyped error.
DECODE_ERROR_TEXT = "\n[decode error: "
MAX_EVENT_BYTES = 1 << 20  # one event larger than this is passed on as it is, unparsed


class EventSplitter:
    """Bytes as they arrive -> whole events (each with its blank line), the rest kept."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The whole events ``data`` completes."""
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        buf = self._rest + data if self._rest else data
        events = []
        start = 0  # each event sliced once (slicing off the rest each time is quadratic)
        while (end := buf.find(b"\n\n", start)) >= 0:
            events.append(buf[start : end + 2])
            start = end + 2
        rest = buf[start:] if start else buf
        if len(rest) > MAX_EVENT_BYTES:
            events.append(rest)
            rest = b""
        self._rest = rest
        return events

    def rest(self) -> bytes:
        """What arrived after the last whole event (a stream cut mid-event)."""
        return self._rest


def event_data(event: bytes) -> bytes | None:
    """The ``data:`` payload of one event (its data lines joined); None without one."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


def plain_content(event: bytes) -> bool:
    """Whether ``event`` is surely one chunk of content that ends nothing, read from its bytes:
    one ``data:`` line of one choice whose ``finish_reason`` is null and whose content is not
    empty, and no error, usage, decode error or ``[DONE]`` in it. A JSON string escapes its
    quotes, so the keys matched here are keys, never text. Anything else (False) is parsed."""
    if not event.startswith(b"data: {") or event.count(b"\n") != 2:
        return False
    at = event.find(b'"finish_reason"')
    if at < 0 or event.find(b'"finish_reason"', at + 1) >= 0:
        return False
    if not event[at + 15 : at + 24].lstrip(b": ").startswith(b"null"):
        return False
    if b'"error"' in event or b'"usage"' in event or b"[d" in event or b"[D" in event:
        return False  # an error, usage, a decode error in the text, [DONE]: parsed
    at = event.find(b'"content"')
    if at < 0:
        return False
    value = event[at + 9 : at + 14].lstrip(b": ")
    return value[:1] == b'"' and value[1:2] not in (b'"', b"")


def error_event(message: str, kind: str, **extra: Any) -> bytes:
    """An SSE error event in OpenAI's error shape."""
    body = {"error": {"message": message, "type": kind, **extra}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _decoded(data: bytes) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict) and choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


def _plain_chunk(chunk: dict[str, Any]) -> bool:
    """Whether a chunk's choices carry only text (no reasoning, tool calls, logprobs)."""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("logprobs"):
            return False
        delta = choice.get("delta") or {}
        if any(v for k, v in delta.items() if k not in ("role", "content")):
            return False
    return True


def _content(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            text += ((choice.get("delta") or {}).get("content")) or ""
            text += choice.get("text") or ""
    return text


@dataclass
class StreamWatch:
    """One proxied stream's state: what it passed on and how it ended."""

    want_usage: bool = False
    held: bytes | None = None  # the finish chunk, until the next event
    finish: str | None = None
    done: bool = False
    truncated: str | None = None  # why the stream is a cut, once it is one
    usage_seen: bool = False
    chunks: int = 0  # content-bearing chunks passed on (the completion tokens when counted)
    model: str = ""
    chunk_id: str = ""
    created: int = 0
    upstream_error: dict[str, Any] | None = field(default=None)
    # The router's error in words (its error chunk's ``error``, or the decode's error text).
    error_text: str | None = None
    events: int = 0  # events with data read (a comment or keep-alive is none)
    keep_text: bool = False  # keep the reply's text (``text``): a canary's, a resumable stream's
    # A cut says nothing yet (``agent.front.resume`` continues it, or says ``cut_events``).
    quiet_cut: bool = False
    # With ``keep_text``: the parsed chunks carried only text (``plain`` adds the unparsed ones).
    _plain: bool = True
    # With ``keep_text``: the reply's text, in order: a parsed chunk's text, or the bytes of a
    # content chunk the byte scan passed on, decoded only when the text is asked for (``text``,
    # ``plain``: a cut to continue, a canary's reply), so a resumable stream's tokens cost the
    # byte scan's, not a parse each (docs/performance.md, "The front beside the floors").
    _texts: list[str | bytes] = field(default_factory=list)
    _held_text: str = ""  # the held finish chunk's own text (not sent if the stream is cut)

    @property
    def text(self) -> str:
        """The reply's text so far (with ``keep_text``)."""
        self._decode_kept()
        return "".join(t for t in self._texts if isinstance(t, str))

    @property
    def plain(self) -> bool:
        """With ``keep_text``: every chunk carried only text (the stream can be continued)."""
        self._decode_kept()
        return self._plain

    def _decode_kept(self) -> None:
        """The kept bytes of the chunks the byte scan passed on, decoded: their text in place,
        whether they carried only text (reasoning, tool calls, logprobs: not plain)."""
        for i, kept in enumerate(self._texts):
            if isinstance(kept, bytes):
                chunk = _decoded(event_data(kept) or b"") or {}
                self._texts[i] = _content(chunk)
                self._plain = self._plain and _plain_chunk(chunk)

    @property
    def ended(self) -> bool:
        """Whether the stream has said its last: ``[DONE]`` passed, or a cut."""
        return self.done or self.truncated is not None

    def push(self, event: bytes) -> list[bytes]:
        """One event from the router -> what the client gets now."""
        if self._unparsed(event):
            return [event]
        data = event_data(event)
        self.events += data is not None
        if self.ended:
            return []  # after [DONE] or the cut's own events: nothing more
        if data is None:
            return [event]  # a comment or keep-alive
        if data.strip() == b"[DONE]":
            return self._end()
        chunk = _decoded(data)
        if chunk is None:
            return [event]
        content = _content(chunk)
        if (cut := self._failed(chunk, content)) is not None:
            return cut
        self.chunk_id = chunk.get("id") or self.chunk_id
        self.model = chunk.get("model") or self.model
        self.created = chunk.get("created") or self.created
        out = self._release()
        if "usage" in chunk and not chunk.get("choices"):
            self.usage_seen = True
        if content:
            self.chunks += 1
            if self.keep_text:
                self._texts.append(content)
        if self.keep_text and self._plain:
            self._plain = _plain_chunk(chunk)
        reason = _finish_reason(chunk)
        if reason is not None:
            self.finish = reason
            self.held, self._held_text = event, content
            return out
        return [*out, event]

    def _failed(self, chunk: dict[str, Any], content: str) -> list[bytes] | None:
        """The cut's events when ``chunk`` says the stream failed (the router's error chunk, the
        decode's error in the text), else None."""
        if "error" in chunk:
            error = chunk["error"]
            self.upstream_error = error if isinstance(error, dict) else {"error": error}
            self.error_text = str(error)
            return self._cut("the router sent an error mid-stream")
        if content.startswith(DECODE_ERROR_TEXT):
            self.error_text = content.strip()
            self.upstream_error = {"error": self.error_text}
            return self._cut("the decode sent an error mid-stream")
        return None

    def _unparsed(self, event: bytes) -> bool:
        """Whether ``event`` is a token passed on as it came, counted from its bytes alone (most
        events: only one that can end the stream is parsed; with ``keep_text`` its bytes are
        kept, parsed when the text is asked for; docs/performance.md, "The front beside the
        floors")."""
        if self.held is not None or not self.chunk_id:
            return False
        if not plain_content(event):
            return False
        self.events += 1
        self.chunks += 1
        if self.keep_text:
            self._texts.append(event)
        return True

    def end(self) -> list[bytes]:
        """The router's stream ended (cleanly or not) -> the client's last events."""
        if self.ended:
            return []
        if self.finish is None:
            return self._cut("the stream ended without a finish reason")
        return self._cut("the stream ended without [DONE]")

    def cut(self, why: str) -> list[bytes]:
        """The stream is given up here (``why``: its source failed) -> the client's last events:
        the ``stream_truncated`` error event and ``[DONE]`` (nothing once it ended)."""
        return [] if self.ended else self._cut(why)

    def _release(self) -> list[bytes]:
        held, self.held = self.held, None
        return [held] if held is not None else []

    def _end(self) -> list[bytes]:
        if self.finish is None:
            return self._cut("the stream ended without a finish reason")
        self.done = True
        out = self._release()
        if self.want_usage and not self.usage_seen:
            out.append(self._usage())
        return [*out, DONE]

    def _usage(self) -> bytes:
        """A usage chunk the router did not send: completion tokens counted from the chunks."""
        usage = {"prompt_tokens": None, "completion_tokens": self.chunks, "total_tokens": None}
        body = {
            "id": self.chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _cut(self, why: str) -> list[bytes]:
        """The stream is a cut: the held ``stop`` is dropped, the error event and [DONE] sent
        (with ``quiet_cut``, later: ``cut_events``)."""
        self.truncated = why
        if self.held is not None and self._held_text:  # its text never reached the client
            self.chunks -= 1
            if self.keep_text:
                self._texts.pop()
        self.held = None
        return [] if self.quiet_cut else self.cut_events()

    def cut_events(self, before: int = 0) -> list[bytes]:
        """The client's last events of a cut: the ``stream_truncated`` error event, [DONE]
        (``before``: the chunks streams before this one sent, when it continued them)."""
        why = self.truncated or "cut"
        chunks = before + self.chunks
        extra: dict[str, Any] = {"code": 502, "chunks": chunks}
        if self.upstream_error is not None:
            extra["upstream"] = self.upstream_error
        message = f"the reply was cut after {chunks} chunk(s): {why}"
        return [error_event(message, "stream_truncated", **extra), DONE]


class StreamReader:
    """TileRT's event stream read as it arrives: each read from the router -> the events the
    client gets now; the stream's state (its text, how it ended) in ``watch``."""

    def __init__(self, chunks: AsyncIterator[bytes], watch: StreamWatch) -> None:
        self.chunks = chunks
        self.watch = watch
        self.splitter = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        """What the client gets for ``data``: the events it completes, through the watch."""
        events = self.splitter.feed(data)
        outs = [out for event in events for out in self.watch.push(event)]
        if len(outs) == 1:
            return outs[0]
        return b"".join(outs)

    async def read(self) -> bytes | None:
        """The next read from the router, for the client (b"": nothing whole yet); None once the
        router's stream ended. What one read completes goes out as one write: each write costs
        the ASGI server a send (docs/performance.md, "The front's cost")."""
        try:
            data = await anext(self.chunks)
        except StopAsyncIteration:
            return None
        return self.feed(data)

    def end(self) -> bytes:
        """The router's stream ended: the client's last events (a cut marked)."""
        return b"".join(self.watch.end())

    def cut(self, why: str) -> bytes:
        """The stream is given up before its end (``why``): the client's last events."""
        return b"".join(self.watch.cut(why))
