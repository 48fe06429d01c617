"""The OpenAI completions API as the vLLM and router stand-ins both speak it.

Both serve ``/v1/chat/completions`` and ``/v1/completions``: they read the same request fields
(the token budget, the sampling knobs TileRT carries to the decode, ``stream_options``) and frame a
streamed reply the same way (``data: <json>`` events, then ``data: [DONE]``). What each puts in
its replies stays with it (vLLM and TileRT's router order ``usage`` differently, for one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

SSE_DONE = b"data: [DONE]\n\n"
# The sampling parameters the router and the connector pass on to the decode (TileRT 0.1.6's
# router forwards these; ignore_eos makes a benchmark's replies osl tokens long).
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "ignore_eos",
)


def sse_event(data: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as JSON."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def object_name(is_chat: bool) -> str:
    """The ``object`` of a whole (not streamed) reply."""
    return "chat.completion" if is_chat else "text_completion"


def chunk_object_name(is_chat: bool) -> str:
    """The ``object`` of a streamed reply's chunks."""
    return "chat.completion.chunk" if is_chat else "text_completion"


@dataclass(frozen=True)
class ChunkStream:
    """What every chunk of one streamed reply repeats."""

    id: str
    object: str
    created: int
    model: Any

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        """One chunk with ``choices`` (and ``extra`` fields such as ``usage``)."""
        data = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return sse_event(data)


def max_tokens(body: Mapping[str, Any], default: int) -> Any:
    """The token budget a request asks for (``max_completion_tokens`` first), else ``default``."""
    return body.get("max_completion_tokens") or body.get("max_tokens") or default


def sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters a request sets, among those TileRT carries."""
    return {k: body[k] for k in SAMPLING_KEYS if k in body}


def include_usage(body: Mapping[str, Any]) -> bool:
    """Whether a streamed reply should end with a usage chunk (``stream_options``)."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))
