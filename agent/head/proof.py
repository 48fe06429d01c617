"""Ready means proven: canaries through the router, once at the job's start and again after any
restart (an engine's or the router's) before the job is ``ready`` again; after them, each decode's
answers are checked (``agent.canary.verify``: ``agent.head.answers``; a decode found wrong is
failed, and the ``PoolKeeper`` drops it).

A re-proof runs beside the serving head (its canary budget can be long); one that fails is said
in the degraded reason and tried again after ``PROOF_RETRY_S``, never failing the job.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext

import trio

from agent.head.canaries import Canary, run_canaries
from agent.head.context import HeadContext
from agent.head.decisions import JobFailed, JobView, proof_due, restart_marks
from agent.job.logfiles import log_path
from agent.job.names import ROUTER_NAME

# A front slot, held by each canary and each decode's answer check (``FrontDoor.canary_slot``).
Gate = Callable[[], AbstractAsyncContextManager[object]]
# Check the answers of these decodes (None: the router's list now), each holding a slot; the names
# found wrong (``PoolKeeper.check_answers``).
CheckAnswers = Callable[[Sequence[str] | None, Gate], Awaitable[list[str]]]

PROOF_RETRY_S = 5.0  # after a failed re-proof (its whole canary budget spent), try again after this


class Proof:
    """Where the job's proof stands: the restart marks it last passed at, and the one running."""

    def __init__(
        self,
        ctx: HeadContext,
        router_url: str,
        view: Callable[[], JobView],
        poke: Callable[[], None],
        gate: Gate = nullcontext,
        check: CheckAnswers | None = None,
    ) -> None:
        self.ctx = ctx
        # Each canary holds one of the front door's slots (``FrontDoor.canary_slot``).
        self.gate = gate
        self.check = check
        self.router_url = router_url
        self.view = view
        self.poke = poke
        # The restart marks (decisions.restart_marks) when a canary last passed: any restart
        # since then keeps the job degraded until a canary passes again.
        self.proven: dict[str, int] | None = None
        self.running = False
        self.where = ""  # where the next proof stands (shown in the degraded reason)
        self.next_at = 0.0  # trio's clock: no re-proof before (one failed)

    async def canaries(self, count: int) -> list[float]:
        """One canary per decode at once through the router; their latencies, or ``JobFailed``."""
        return await run_canaries(
            Canary.for_plan(self.ctx.plan, self.router_url),
            count,
            client=self.ctx.client,
            log=self.ctx.log,
            router_log=log_path(self.ctx.job, ROUTER_NAME, plan=self.ctx.plan),
            gate=self.gate,
        )

    async def answers(self, names: Sequence[str] | None = None) -> list[str]:
        """Check the answers of ``names`` (None: the router's list now), each holding a front
        slot as a canary does, so a check and a client never meet on one decode; those found
        wrong."""
        if self.check is None:
            return []
        return await self.check(names, self.gate)

    def start_if_due(self, view: JobView, dropped: Collection[str], nursery: trio.Nursery) -> None:
        """Start a re-proof when something restarted since the last one passed and everything the
        job uses is healthy again (none runs, and a failed one's pause is over)."""
        if (
            proof_due(view, dropped, self.proven)
            and not self.running
            and trio.current_time() >= self.next_at
        ):
            self.running = True
            live = [n for n in view.decodes if n not in dropped]
            nursery.start_soon(self._prove, restart_marks(view), len(live))

    async def _prove(self, marks: dict[str, int], count: int) -> None:
        """Canaries after a restart: the job is ``ready`` again only once they pass."""
        log = self.ctx.log
        log.info(
            "head: every worker and the router healthy again; proving with %d canary(s)", count
        )
        self.where = "healthy again; canary through the router running"
        try:
            latencies = await self.canaries(count)
            await self.answers()  # the wrong ones are failed: the serving head drops them
        except JobFailed as exc:
            # Degrade, don't die: say why and try again.
            self.where = f"healthy again, but the canary failed: {exc}"
            self.next_at = trio.current_time() + PROOF_RETRY_S
            log.warning("head: re-proof failed; retrying in %gs: %s", PROOF_RETRY_S, exc)
        else:
            self.ctx.figures.canary_latency_s = latencies
            if restart_marks(self.view()) == marks:
                self.proven = marks
                log.info("head: canaries answered after the restart: serving again")
            self.where = ""
        finally:
            self.running = False
            self.poke()
