"""The proof that the job serves: one streaming chat per decode node, through the router, at once.

The router's ``/health`` proves nothing about the decodes behind it; a chat that streams text does.
Each canary is retried until the budget (``agent.canary.timeout_s``) is spent: a router that has
just turned healthy may still be connecting to its decodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from agent.head.decisions import JobFailed
from agent.job.plan import Plan

CANARY_RETRY_S = 0.5
CONNECT_TIMEOUT_S = 5.0


class CanaryFailed(Exception):
    """One canary attempt streamed no text (retried while the budget lasts)."""


def canary_text(line: str) -> str:
    """The text one line of the router's event stream carries ("" for anything else).

    Raises ``CanaryFailed`` for an error chunk: the router reports a failed decode that way.
    """
    if not line.startswith("data:"):
        return ""
    data = line[5:].strip()
    if data == "[DONE]" or not data:
        return ""
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return ""
    if not isinstance(chunk, dict):
        return ""
    if "error" in chunk:
        raise CanaryFailed(f"canary got an error chunk from the router: {chunk['error']}")
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
    return text


@dataclass(frozen=True)
class Canary:
    """The chat request every canary sends, where, and how long to keep trying."""

    router_url: str
    model: str
    prompt: str
    max_tokens: int
    timeout_s: float

    @classmethod
    def for_plan(cls, plan: Plan, router_url: str) -> Canary:
        """The canary of a job (``agent.canary`` in the recipe)."""
        return cls(
            router_url=router_url,
            model=plan.model,
            prompt=plan.agent.canary_prompt,
            max_tokens=plan.agent.canary_max_tokens,
            timeout_s=plan.agent.canary_timeout_s,
        )

    def body(self) -> dict[str, Any]:
        """The streaming chat completion request."""
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }


async def run_canaries(
    canary: Canary,
    count: int,
    *,
    log: logging.Logger,
    router_log: Path,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[float]:
    """Send ``count`` canaries at once; each must stream text. Their latencies, or ``JobFailed``."""
    deadline = trio.current_time() + canary.timeout_s
    url = f"{canary.router_url}/v1/chat/completions"
    body = canary.body()
    latencies: list[float] = []
    errors: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        while True:
            t0 = trio.current_time()
            try:
                text = ""
                async with client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace")[:300]
                        raise CanaryFailed(f"router answered {response.status_code}: {detail}")
                    async for line in response.aiter_lines():
                        text += canary_text(line)
                if text.strip():
                    latencies.append(trio.current_time() - t0)
                    log.info("head: canary %d/%d answered %r", i + 1, count, text[:60])
                    return
                raise CanaryFailed("router streamed no text")
            except (CanaryFailed, httpx.HTTPError) as exc:
                if trio.current_time() > deadline:
                    errors.append(f"canary {i + 1}: {exc}")
                    return
                log.info("head: canary %d/%d not yet: %s", i + 1, count, exc)
                await trio.sleep(CANARY_RETRY_S)

    timeout = httpx.Timeout(canary.timeout_s, connect=CONNECT_TIMEOUT_S)
    async with (
        httpx.AsyncClient(timeout=timeout, transport=transport) as client,
        trio.open_nursery() as nursery,
    ):
        for i in range(count):
            nursery.start_soon(one, client, i)
    if errors:
        raise JobFailed(
            f"the router at {canary.router_url} did not serve {count} canary chat requests within "
            f"{canary.timeout_s:g}s (agent.canary.timeout_s): {'; '.join(errors)}; "
            f"see {router_log}"
        )
    return latencies
