"""The proof that the job serves: one streaming chat per decode node, through the router, at once.

The router's ``/health`` proves nothing about the decodes behind it; a chat that streams text does.
Each attempt is bounded (``agent.canary.attempt_timeout_s``) and retried until the canary budget
(``agent.canary.timeout_s``) is spent: a router that has just turned healthy may still be
connecting to its decodes, and a first request to a freshly started vLLM can take tens of seconds.
Every failed attempt says why (``CanaryFailed``): a timeout, a refused connection, the HTTP status
and body, an error chunk (or a decode's error in the text), or a stream without text. The reply is
read by the front door's reader of TileRT's stream (``agent.front.sse``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from agent.errors import RuntimeFailure
from agent.front.sse import StreamReader, StreamWatch
from agent.head.decisions import JobFailed
from agent.job.plan import Plan
from agent.problems import printable

CANARY_RETRY_S = 0.5
CONNECT_TIMEOUT_S = 5.0


class CanaryFailed(RuntimeFailure):
    """One canary attempt streamed no text; the message is the cause (retried while budget
    lasts)."""


def failure_cause(exc: BaseException) -> str:
    """What went wrong in one attempt, in words (httpx's own messages can be empty)."""
    if isinstance(exc, CanaryFailed):
        return str(exc)
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return f"timeout: no connection to the router within {CONNECT_TIMEOUT_S:g}s"
    if isinstance(exc, httpx.ConnectError):
        return f"connection refused or failed: {detail}"
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout: {detail}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the router broke the connection: {detail}"
    return f"{type(exc).__name__}: {detail}"


def reply_text(watch: StreamWatch) -> str:
    """The text a canary's reply streamed, as the front's reader saw it (``agent.front.sse``).

    Raises ``CanaryFailed`` for an error chunk or a decode's error in the text (the router reports
    a failed decode either way: the front would mark the reply cut), or a reply without text.
    """
    if watch.error_text is not None:
        raise CanaryFailed(f"canary got an error chunk from the router: {watch.error_text}")
    if not watch.text.strip():
        raise CanaryFailed(
            f"router streamed no text ({watch.events} event(s), then the stream ended)"
        )
    return watch.text


@dataclass(frozen=True)
class Canary:
    """The chat request every canary sends, where, and how long to keep trying."""

    router_url: str
    model: str
    prompt: str
    max_tokens: int
    timeout_s: float
    # Each attempt's bound (never more than what is left of ``timeout_s``).
    attempt_timeout_s: float = 60.0

    @classmethod
    def for_plan(cls, plan: Plan, router_url: str) -> Canary:
        """The canary of a job (``agent.canary`` in the recipe)."""
        return cls(
            router_url=router_url,
            model=plan.model,
            prompt=plan.agent.canary_prompt,
            max_tokens=plan.agent.canary_max_tokens,
            timeout_s=plan.agent.canary_timeout_s,
            attempt_timeout_s=plan.agent.canary_attempt_timeout_s,
        )

    def body(self) -> dict[str, Any]:
        """The streaming chat completion request."""
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }


async def _attempt(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], bounds: httpx.Timeout
) -> str:
    """One canary chat: the text it streamed; ``CanaryFailed`` (or httpx's error) otherwise."""
    # Connection: close, so no idle connection is left per decode in the router's pool (httpcore
    # looks at each idle one on every request: with 1,024 decodes that is a million looks).
    headers = {"Connection": "close"}
    async with client.stream("POST", url, json=body, timeout=bounds, headers=headers) as response:
        if response.status_code != 200:
            detail = printable((await response.aread()).decode(errors="replace").strip()[:300])
            raise CanaryFailed(
                f"router answered HTTP {response.status_code}: {detail or '(no body)'}"
            )
        reader = StreamReader(response.aiter_bytes(), StreamWatch(keep_text=True))
        while not reader.watch.ended and await reader.read() is not None:
            pass
    return reply_text(reader.watch)


async def run_canaries(
    canary: Canary,
    count: int,
    *,
    client: httpx.AsyncClient,
    log: logging.Logger,
    router_log: Path,
    gate: Callable[[], AbstractAsyncContextManager[object]] = nullcontext,
) -> list[float]:
    """Send ``count`` canaries at once; each must stream text. Their latencies, or ``JobFailed``.

    ``gate``: each attempt holds one of the front's slots of the router's decodes (ahead of its
    queue), so a canary meets a free decode and the front counts it (``agent.front.admission``).
    """
    deadline = trio.current_time() + canary.timeout_s
    url = f"{canary.router_url}/v1/chat/completions"
    body = canary.body()
    latencies: list[float] = []
    errors: list[str] = []

    # The attempt's own bound cuts a slow read; httpx's timeouts only back it up.
    timeout = httpx.Timeout(canary.attempt_timeout_s, connect=CONNECT_TIMEOUT_S)

    async def one(i: int) -> None:
        attempts = 0
        while True:
            t0 = trio.current_time()
            # The last attempt may overrun the budget a little rather than be cut to nothing.
            bound = min(canary.attempt_timeout_s, max(deadline - t0, CANARY_RETRY_S))
            attempts += 1
            cause = ""
            with trio.move_on_after(max(bound, 0.0)) as scope:
                try:
                    async with gate():
                        text = await _attempt(client, url, body, timeout)
                except (CanaryFailed, httpx.HTTPError) as exc:
                    cause = failure_cause(exc)
                else:
                    latencies.append(trio.current_time() - t0)
                    log.info("head: canary %d/%d answered %r", i + 1, count, text[:60])
                    return
            if scope.cancelled_caught:
                cause = f"timeout: no answer within {bound:g}s (agent.canary.attempt_timeout_s)"
            if trio.current_time() >= deadline:
                errors.append(f"canary {i + 1}: {cause} (attempt {attempts})")
                return
            log.info("head: canary %d/%d not yet: %s", i + 1, count, cause)
            await trio.sleep(CANARY_RETRY_S)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    if errors:
        raise JobFailed(
            f"the router at {canary.router_url} did not serve {count} canary chat requests within "
            f"{canary.timeout_s:g}s (agent.canary.timeout_s): {'; '.join(errors)}; "
            f"see {router_log}"
        )
    return latencies
