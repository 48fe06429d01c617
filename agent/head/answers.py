"""Which decodes answered wrong (``agent.canary.verify``), and the head's rounds of checks.

A round runs after the canaries through the router passed: at bring-up, after every restart
(an engine's, a rejoin's, a pool change's router hand-over: the head's re-proof) and for decodes
joining the pool before they take traffic. The prefill's own answers are asked once per round,
then every decode is checked at once (``agent.head.verify``). A decode whose answers are wrong
is ``failed`` in the head's view with that reason (so the head drops it from the router's list
like any failed decode, and ``status`` and ``diagnose`` show why) until its engine restarts: its
agent is not asked to restart it, since restarting does not fix a mismatch. Once its engine has
restarted it is healthy again in the head's view, taken back like any dropped decode (within
``agent.max_rejoins``) and checked again by the re-proof that follows. A round that cannot
conclude for a decode (busy, timeouts) says so in the head's log and leaves it as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field

import trio

from agent.head.context import HeadContext
from agent.head.router import decode_endpoints
from agent.head.verify import PROMPTS, Inconclusive, Verdict, Verifier, verify_decode
from agent.job.records import JobAgent, RendezvousRecord


@dataclass
class Answers:
    """The decodes found wrong, each with its restart count then (a restart clears it)."""

    ctx: HeadContext
    # name -> (why its answers are wrong, its restart count when found)
    wrong: dict[str, tuple[str, int]] = field(default_factory=dict)
    # The last verdict per decode (the tests and the head's log read the scores from it).
    last: dict[str, Verdict] = field(default_factory=dict)

    @property
    def log(self) -> logging.Logger:
        """The head's log."""
        return self.ctx.log

    def mark(self, row: JobAgent) -> None:
        """``row`` as the head sees it: ``failed`` with the reason while its answers are wrong."""
        found = self.wrong.get(row.name)
        if found is not None and found[1] == row.restarts:
            row.state, row.reason = "failed", f"{row.name}: {found[0]}"

    async def check(
        self,
        names: list[str],
        records: Mapping[str, RendezvousRecord],
        restarts: Mapping[str, int],
        gate: Callable[[], AbstractAsyncContextManager[object]] = nullcontext,
    ) -> list[str]:
        """Check ``names`` (off: nothing); the names found wrong now. ``gate``: each decode's
        check holds one of the front's slots (``FrontDoor.canary_slot``), as a canary does: the
        check asks the decode itself, and the front then sends the router one request fewer."""
        plan = self.ctx.plan
        names = [n for n in names if n in records]  # a decode without a record cannot be asked
        if not plan.agent.canary_verify or not names:
            return []
        verifier = Verifier(
            self.ctx.client,
            self.ctx.prefill_url(),
            plan.model,
            plan.agent.canary_verify_margin,
            plan.agent.canary_attempt_timeout_s,
        )
        deadline = trio.current_time() + plan.agent.canary_timeout_s
        try:
            references = [await verifier.reference(p) for p in PROMPTS]
        except Inconclusive as exc:
            self.log.warning("head: answers not checked: the prefill's own answers failed: %s", exc)
            return []
        endpoints = dict(zip(names, decode_endpoints(records, names), strict=True))
        verdicts: dict[str, Verdict] = {}

        # The wait for a slot counts against the budget; the last request may overrun it a little.
        bound = plan.agent.canary_timeout_s + plan.agent.canary_attempt_timeout_s

        async def one(name: str) -> None:
            with trio.move_on_after(bound) as scope:
                try:
                    async with gate():
                        verdicts[name] = await verify_decode(
                            verifier, name, endpoints[name], references, deadline
                        )
                except Inconclusive as exc:
                    self.log.warning("head: %s's answers not checked this time: %s", name, exc)
            if scope.cancelled_caught:
                self.log.warning(
                    "head: %s's answers not checked this time: no front slot or answer within "
                    "%gs (agent.canary.timeout_s)",
                    name,
                    bound,
                )

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(one, name)
        return self._take(verdicts, restarts)

    def _take(self, verdicts: dict[str, Verdict], restarts: Mapping[str, int]) -> list[str]:
        """Record the verdicts; log each decode's scores; the names found wrong."""
        wrong = []
        for name, found in sorted(verdicts.items()):
            self.last[name] = found
            scores = ", ".join(f"{j.score:.3g} vs {j.own:.3g}" for j in found.judged)
            if found.wrong is None:
                self.wrong.pop(name, None)
                self.log.info(
                    "head: %s answers right (mean log-prob per token, decode vs prefill: %s)",
                    name,
                    scores,
                )
                continue
            wrong.append(name)
            self.wrong[name] = (found.wrong, restarts.get(name, 0))
            self.log.error("head: %s is failed: %s", name, found.wrong)
        return wrong
