"""The OpenAI surface the front adds to TileRT 0.1.6's router: ``/v1/models``, the requests it
cannot serve refused with a clear 400, and OpenAI's error shape for every error the front says.

TileRT's router serves ``/v1/chat/completions`` (streamed or not) and ``/v1/completions``
(not streamed); it has no ``/v1/models`` and answers some unsupported parameters with 501 only
after asking a decode, or not at all. What is refused here is listed in ``UNSUPPORTED`` and in
docs/agent.md ("The front door").
"""

from __future__ import annotations

from typing import Any

import msgspec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Endpoints of OpenAI's API that TileRT 0.1.6 has no engine for: 404 with this reason.
NO_ENGINE = {
    "/v1/embeddings": "TileRT 0.1.6 serves no embeddings",
    "/v1/responses": "TileRT 0.1.6's router serves no Responses API; use /v1/chat/completions",
    "/v1/audio/transcriptions": "TileRT 0.1.6 serves no audio",
    "/v1/audio/speech": "TileRT 0.1.6 serves no audio",
    "/v1/images/generations": "TileRT 0.1.6 serves no images",
    "/v1/moderations": "TileRT 0.1.6 serves no moderations",
}


def error_body(message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", ...}}``."""
    return {"error": {"message": message, "type": kind, **extra}}


def models_body(model: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model the job serves, in OpenAI's list format."""
    entry = {"id": model, "object": "model", "created": created, "owned_by": "tilert-agent"}
    return {"object": "list", "data": [entry]}


def _count_above_one(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return f"{key}={value}: the decode produces exactly one sequence per request; send {key}=1"
    return None


def unsupported(path: str, body: dict[str, Any]) -> str | None:
    """Why TileRT 0.1.6 cannot serve this request (a clear 400), or None."""
    for key in ("n", "best_of"):
        why = _count_above_one(body, key)
        if why is not None:
            return why
    if body.get("use_beam_search"):
        return "use_beam_search: the decode runs single-sequence decoding; drop it"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs: the prefill is asked for one token, no prompt distribution"
    if path == COMPLETIONS and body.get("stream"):
        return "stream on /v1/completions: TileRT 0.1.6 streams /v1/chat/completions only"
    if path == COMPLETIONS and body.get("logprobs") is not None:
        return "logprobs on /v1/completions: TileRT 0.1.6 serves logprobs on chat only"
    if path == COMPLETIONS and body.get("echo"):
        return "echo on /v1/completions: the prompt is not returned by TileRT 0.1.6"
    return None


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed request asked for a usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def upstream_error(status: int, content: bytes) -> dict[str, Any]:
    """The router's own error answer in OpenAI's shape (its message kept)."""
    try:
        value = msgspec.json.decode(content)
    except msgspec.DecodeError:
        value = content.decode(errors="replace")[:500]
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        return value
    if isinstance(value, dict):
        message = str(value.get("error") or value.get("detail") or value)
        kind = str(value.get("error_type") or "upstream_error")
    else:
        message, kind = str(value), "upstream_error"
    return error_body(message, kind, code=status)
