"""What a front answers itself, in OpenAI's error shape: a request body read within its bounds
(413, 408, 400), the router's last refusal (its 4xx passed on, a failure as 502/503), the queue's
429, the toolkit's own refusals. The job's front door (``agent.front.app``) and the service front
(``agent.service.front``) answer with these, so a client sees one shape from both."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import trio

from agent.errors import BadInput
from agent.front.admission import QueueRefused
from agent.front.figures import Outcome
from agent.front.openai import error_body, unsupported, upstream_error
from agent.front.proxy import Refused
from agent.job.frontpolicy import FrontPolicy
from agent.web.asgi import HTTPError, Request, Response, decode_json, json_response

RETRY_AFTER_S = 2


class BodyError(BadInput):
    """A request body the front refuses before it reaches the router (413, 408, 400): the
    client's to fix; answered, never an exit."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error(status: int, message: str, kind: str, **headers: str) -> Response:
    """An error answer in OpenAI's shape, with ``headers`` (Retry-After ...)."""
    response = json_response(error_body(message, kind, code=status), status)
    response.headers.update(headers)
    return response


def unavailable(message: str) -> Response:
    """503 with Retry-After: nothing can serve the request now."""
    return error(503, message, "unavailable", **{"retry-after": str(RETRY_AFTER_S)})


def refused(refused: Refused) -> tuple[Response, Outcome]:
    """The router's last answer: its 4xx passed on (a 501 said as 400), a failure as 502/503."""
    failure = refused.failure
    status = failure.status
    if status is not None and 400 <= status < 500 and failure.reason != "busy":
        return json_response(upstream_error(status, refused.content), status), "rejected"
    if status == 501:
        body = upstream_error(400, refused.content)
        body["error"]["type"] = "unsupported"
        return json_response(body, 400), "rejected"
    message = f"the router could not serve the request in {refused.tries} tries: "
    answer = 503 if status in (None, 429, 503) else 502
    body = error_body(message + failure.message[:500], "upstream_failed", code=answer)
    response = json_response(body, answer)
    response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response, "failed"


def toolkit_refusal(status: int, message: str) -> Response:
    """What the toolkit answers itself (no route, a header that is not UTF-8, a handler that
    failed), in OpenAI's error shape like every other answer of the front."""
    kinds = {404: "not_found", 405: "method_not_allowed", 500: "server_error"}
    kind = kinds.get(status, "invalid_request")
    return error(status, message, kind)


def queue_refusal(exc: QueueRefused) -> Response:
    """429 past the queue's bound (503 when no decode was in the pool at all), in OpenAI's
    shape, with its reason and Retry-After."""
    kind = "rate_limit_exceeded" if exc.status == 429 else "unavailable"
    body = error_body(str(exc), kind, code=exc.status, reason=exc.reason)
    response = json_response(body, exc.status)
    response.headers["retry-after"] = str(exc.retry_after_s)
    return response


async def read_json(request: Request, policy: FrontPolicy) -> tuple[bytes, dict[str, Any]]:
    """The request's body within ``agent.front.max_body_bytes`` and ``body_timeout_s``, and the
    JSON object it holds (``BodyError`` otherwise)."""
    limit = policy.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyError(413, _too_big(limit), "request_too_large")
    body = await _bounded_body(request, limit, policy.body_timeout_s)
    try:
        value = decode_json(body)
    except HTTPError as exc:
        raise BodyError(exc.status, exc.message, "invalid_request") from None
    if not isinstance(value, dict):
        raise BodyError(400, "the request body must be a JSON object", "invalid_request")
    return body, value


def _too_big(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (agent.front.max_body_bytes)"


async def _bounded_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body read within ``limit`` bytes and ``timeout_s`` (a slow client gets 408)."""
    parts: list[bytes] = []
    size = 0
    # Closed at once when it is refused part-way (not left to the collector).
    with trio.move_on_after(timeout_s) as scope:
        async with aclosing(request.stream()) as arriving:
            async for part in arriving:
                size += len(part)
                if size > limit:
                    raise BodyError(413, _too_big(limit), "request_too_large")
                parts.append(part)
    if scope.cancelled_caught:
        raise BodyError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (agent.front.body_timeout_s)",
            "timeout",
        )
    return b"".join(parts)


async def servable(
    request: Request, policy: FrontPolicy
) -> tuple[bytes, dict[str, Any]] | Response:
    """The request's body and its JSON (``read_json``) when TileRT can serve it, else the 4xx
    to answer: a bad body, or what TileRT 0.1.6 cannot do."""
    try:
        body, value = await read_json(request, policy)
    except BodyError as exc:
        return error(exc.status, exc.message, exc.kind)
    why = unsupported(request.path, value)
    if why is not None:
        return error(400, why, "unsupported")
    return body, value
