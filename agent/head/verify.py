"""The verified canary (``agent.canary.verify``): each decode's greedy answers checked against the
prefill engine's own model.

The canaries through the router prove that every decode streams text; they cannot tell right
tokens from fluent garbage (a KV layout, dtype or scale mismatch, a wrong model profile, a decode
from another image all answer 200). So, for each decode and each of ``PROMPTS``, the head does
what the router does, aimed at that one decode: the prefill computes the prompt and sends its KV
to the decode (``/v1/completions``, ``max_tokens: 1``, ``kv_transfer_params`` naming the decode),
then the decode answers (``/pd/decode``, greedy, ``ANSWER_TOKENS``). The prefill's vLLM sees the
same weights without any KV transfer: asked without ``kv_transfer_params`` (TileRT's connector
then claims nothing and sends nothing: docs/agent.md) it gives its own greedy continuation and
scores the decode's (``prompt_logprobs`` on prompt + answer). An answer passes when its first
``AGREE_TOKENS`` tokens after the prefill's first token are the prefill's own, or when its mean
log-probability per token under the prefill's model is within ``agent.canary.verify_margin`` of
the prefill's own continuation's. A decode is wrong when most of its prompts fail (one prompt
may legitimately diverge where two tokens are nearly tied); a request that fails (busy, a
timeout) proves nothing either way and is tried again, within the canary's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from agent.errors import RuntimeFailure
from agent.facts import derive_rid
from agent.launch.commands import DecodeEndpoint
from agent.problems import printable

PROMPTS = ("The quick brown fox", "1, 2, 3, 4,", "Paris is the capital of")
ANSWER_TOKENS = 8
AGREE_TOKENS = 4
TOKEN_PREFIX = "token_id:"  # the prefill's tokens with return-tokens-as-token-ids
BUSY_RETRY_S = 0.5
# What to check when a decode answers wrong (the recipe keys in the user's spelling).
LIKELY_CAUSES = (
    "a KV layout or dtype mismatch (roles.decode.args.kv-cache-dtype against "
    "roles.prefill.args.kv-cache-dtype), a KV transport problem (roles.decode.args.transport, "
    "kv_connector_extra_config.tilert_transport), other weights or profile (model.path, "
    "roles.decode.args.model-weights-dir, roles.decode.args.model), or another image or tilert "
    "version (roles.decode.container, frameworks.tilert)"
)


class Inconclusive(RuntimeFailure):
    """A verification request failed (busy decode, timeout, bad reply): nothing proven."""


@dataclass(frozen=True)
class Reference:
    """The prefill's own greedy answer to one prompt, without any KV transfer."""

    prompt: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    text: str


@dataclass(frozen=True)
class Judged:
    """One decode answer against the prefill's: both mean log-probs per token (the decode's
    continuation scored by the prefill's model; the prefill's own) and the verdict."""

    reference: Reference
    answer: list[int]
    text: str
    score: float
    own: float
    agree: bool
    passed: bool

    def describe(self) -> str:
        """``'The quick brown fox' -> decode 'xyz' [1, 2] (-9.1/token), prefill 'abc' (-0.0)``."""
        ref = self.reference
        return (
            f"{ref.prompt!r} -> decode {self.text!r} {self.answer[:ANSWER_TOKENS]} "
            f"(mean log-prob {self.score:.3g}/token under the prefill's model), prefill "
            f"{ref.text!r} {ref.ids[:ANSWER_TOKENS]} ({self.own:.3g}/token)"
        )


def judge(reference: Reference, answer: list[int], scores: list[float], margin: float) -> Judged:
    """The verdict on one answer (its first token is the prefill's; the rest is the decode's):
    its continuation agrees with the prefill's for ``AGREE_TOKENS`` tokens, or scores within
    ``margin`` nats per token of the prefill's own."""
    n = min(len(answer), len(reference.ids))
    want = reference.ids[1 : 1 + AGREE_TOKENS]
    agree = len(answer) > 1 and answer[1 : 1 + len(want)] == want
    score = _mean(scores[1:n]) if n > 1 else _mean(scores)
    own = _mean(reference.logprobs[1:n]) if n > 1 else _mean(reference.logprobs)
    passed = agree or score >= own - margin
    return Judged(reference, answer, "", score, own, agree, passed)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _token_id(token: Any) -> int:
    """``token_id:123`` -> 123 (the recipe sets return-tokens-as-token-ids)."""
    if isinstance(token, str) and token.startswith(TOKEN_PREFIX):
        return int(token[len(TOKEN_PREFIX) :])
    raise Inconclusive(f"the prefill's token {token!r} is not {TOKEN_PREFIX}N")


def _logprob_of(entry: Any, token: int) -> float:
    """The prompt token's log-prob in one ``prompt_logprobs`` entry (keyed by its id)."""
    if not isinstance(entry, dict):
        raise Inconclusive(f"no prompt log-prob for token {token}")
    found = entry.get(str(token))
    if found is None and len(entry) == 1:
        found = next(iter(entry.values()))
    if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
        raise Inconclusive(f"no prompt log-prob for token {token}: {entry!r}"[:300])
    value = float(found["logprob"])
    return value if math.isfinite(value) else -1e9


@dataclass
class Verifier:
    """Asks the prefill and one decode at a time (``client``: the agent's)."""

    client: httpx.AsyncClient
    prefill_url: str
    model: str
    margin: float
    timeout_s: float = 60.0

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        try:
            response = await self.client.post(url, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise Inconclusive(f"{url}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            detail = printable(response.text.strip()[:300])
            raise Inconclusive(f"{url} answered HTTP {response.status_code}: {detail}")
        try:
            return response.json()
        except ValueError:
            raise Inconclusive(f"{url} answered no JSON: {response.text[:200]!r}") from None

    async def _complete(self, prompt: str | list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "temperature": 0.0, "stream": False}
        reply = await self._post(f"{self.prefill_url}/v1/completions", {**body, **extra})
        try:
            choice: dict[str, Any] = dict(reply["choices"][0])
            choice["id"] = str(reply.get("id", ""))
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise Inconclusive(f"the prefill's completion has no choice: {reply!r}"[:300]) from None
        return choice

    async def text(self, ids: list[int]) -> str:
        """The tokens as text (vLLM's ``/detokenize``)."""
        body = {"model": self.model, "tokens": ids}
        reply = await self._post(f"{self.prefill_url}/detokenize", body)
        return str(reply.get("prompt", "")) if isinstance(reply, dict) else ""

    async def reference(self, prompt: str) -> Reference:
        """The prefill's own greedy answer, asked without ``kv_transfer_params``."""
        tokenized = await self._post(
            f"{self.prefill_url}/tokenize", {"model": self.model, "prompt": prompt}
        )
        choice = await self._complete(prompt, max_tokens=ANSWER_TOKENS, logprobs=0)
        logprobs = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in logprobs.get("tokens") or []]
        values = [float(v) if v is not None else -1e9 for v in logprobs.get("token_logprobs") or []]
        if not ids:
            raise Inconclusive(f"the prefill answered {prompt!r} with no token")
        prompt_ids = tokenized.get("tokens") if isinstance(tokenized, dict) else None
        if not isinstance(prompt_ids, list):
            raise Inconclusive(f"the prefill's /tokenize answered {tokenized!r}"[:300])
        return Reference(prompt, prompt_ids, ids, values, await self.text(ids))

    async def answer(self, decode: DecodeEndpoint, reference: Reference) -> list[int]:
        """The decode's greedy answer: the prefill's KV sent to it, as the router would."""
        choice = await self._complete(
            reference.prompt,
            max_tokens=1,
            logprobs=1,
            kv_transfer_params={"tilert_host": decode.host, "tilert_ctrl_port": decode.ctrl},
        )
        first = _token_id(((choice.get("logprobs") or {}).get("tokens") or [None])[0])
        body = {
            "rid": derive_rid(str(choice["id"])),
            "first_token_id": first,
            "max_tokens": ANSWER_TOKENS,
            "sampling": {"temperature": 0.0},
        }
        reply = await self._post(f"http://{decode.host}:{decode.http}/pd/decode", body)
        ids = reply.get("token_ids") if isinstance(reply, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise Inconclusive(f"the decode's reply has no token_ids: {reply!r}"[:300])
        return ids or [first]

    async def score(self, reference: Reference, answer: list[int]) -> list[float]:
        """Each answer token's log-prob under the prefill's model (``prompt_logprobs``)."""
        choice = await self._complete(
            reference.prompt_ids + answer, max_tokens=1, prompt_logprobs=0
        )
        entries = choice.get("prompt_logprobs") or []
        start = len(reference.prompt_ids)
        if len(entries) < start + len(answer):
            raise Inconclusive(f"the prefill scored {len(entries)} of {start + len(answer)} tokens")
        return [_logprob_of(entries[start + i], t) for i, t in enumerate(answer)]

    async def judge(self, decode: DecodeEndpoint, reference: Reference) -> Judged:
        """One prompt: the decode's answer, scored, judged (``Inconclusive`` on a failure)."""
        answer = await self.answer(decode, reference)
        scores = await self.score(reference, answer)
        judged = judge(reference, answer, scores, self.margin)
        return Judged(
            reference,
            answer,
            await self.text(answer),
            judged.score,
            judged.own,
            judged.agree,
            judged.passed,
        )


@dataclass(frozen=True)
class Verdict:
    """One decode's answers: right (``wrong`` None) or what was wrong, in words."""

    name: str
    judged: list[Judged]
    wrong: str | None


def verdict(name: str, judged: list[Judged], margin: float) -> Verdict:
    """Wrong when most prompts failed: the reason names the answers, both scores, the causes."""
    failed = [j for j in judged if not j.passed]
    if 2 * len(failed) <= len(judged):
        return Verdict(name, judged, None)
    seen = "; ".join(j.describe() for j in failed)
    why = (
        f"its answers are wrong (agent.canary.verify): {len(failed)} of {len(judged)} prompts "
        f"disagree with the prefill's own model beyond {margin:g} nats/token "
        f"(agent.canary.verify_margin): {seen}. Likely causes: {LIKELY_CAUSES}"
    )
    return Verdict(name, judged, why)


async def verify_decode(
    verifier: Verifier,
    name: str,
    decode: DecodeEndpoint,
    references: list[Reference],
    deadline: float,
) -> Verdict:
    """``name``'s verdict, each prompt tried until it is judged or ``deadline`` (trio's clock)
    passes (then ``Inconclusive``, with the last failure)."""
    judged: list[Judged] = []
    for reference in references:
        while True:
            try:
                judged.append(await verifier.judge(decode, reference))
                break
            except Inconclusive:
                if trio.current_time() + BUSY_RETRY_S >= deadline:
                    raise
                await trio.sleep(BUSY_RETRY_S)
    return verdict(name, judged, verifier.margin)
