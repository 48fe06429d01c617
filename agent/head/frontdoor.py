"""The head's front door (``agent.front``): served from the head's start, before the router, on the
socket the node agent bound (``agent.front.port``), told where the router is at every request.

The router's URL and whether it serves come from the router's supervisor at the moment asked: a
router restarting or handed over makes requests wait for the new one (``agent.front.proxy``);
before the router starts and after the job ends, the front answers 503.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext

import trio

from agent.front import Front, RouterNow
from agent.head.context import HeadContext
from agent.head.router import Router
from agent.job.records import FrontSummary, QueueSummary
from agent.job.urls import front_url


class FrontDoor:
    """The job's front door, run by the head in its nursery."""

    def __init__(
        self,
        ctx: HeadContext,
        router: Router,
        router_url: Callable[[], str | None],
        pool: Callable[[], tuple[str | None, tuple[tuple[str, int], ...]]],
    ) -> None:
        self.ctx = ctx
        self.router = router
        self.router_url = router_url
        # Why the router's pool is not whole (or None), and every engine's restart count.
        self.pool = pool
        self.front: Front | None = None
        self.url: str | None = None
        sock, figures = ctx.front_socket, ctx.front_figures
        if sock is not None and figures is not None:
            port = sock.getsockname()[1]
            self.url = front_url(ctx.identity.address, port)
            self.front = Front(
                model=ctx.plan.model,
                policy=ctx.plan.agent.front,
                router=self.now,
                figures=figures,
                capacity=self.capacity,
                log=ctx.log,
            )

    def now(self) -> RouterNow:
        """Where the router is and whether it serves, as the head sees it now."""
        url, sup = self.router_url(), self.router.supervisor
        if url is None or sup is None:
            return RouterNow(None, False, "no router serves this job yet (or any more)")
        why = f"the router is {sup.state}: {sup.reason}"
        settling, marks = self.pool()
        return RouterNow(url, sup.state == "healthy", why, settling, marks)

    def capacity(self) -> int:
        """The decodes the front may keep busy at once: those in the router's list (each serves
        one request; the canaries take their slots too)."""
        return len(self.router.decodes) if self.router.supervisor is not None else 0

    def canary_slot(self) -> AbstractAsyncContextManager[object]:
        """A slot for one canary of the serving router: ahead of the front's queue, so the
        canary finds a free decode and the front sends no more than the decodes left."""
        if self.front is None:
            return nullcontext()
        return self.front.admission.slot(first=True)

    def summary(self) -> FrontSummary | None:
        """The request counts status.json shows; None without a front door."""
        figures = self.ctx.front_figures
        if self.front is None or figures is None:
            return None
        admission = self.front.admission
        queue = QueueSummary(
            waiting=admission.waiting,
            oldest_wait_s=round(admission.oldest_wait_s(), 3),
            admitted=admission.admitted,
            capacity=self.capacity(),
            refused={k: v for k, v in figures.queue_refusals.items() if v},
        )
        return FrontSummary(
            requests={k: v for k, v in figures.tally.items() if v},
            retries={k: v for k, v in figures.retry_tally.items() if v},
            in_flight=figures.in_flight,
            queue=queue,
        )

    def changed(self) -> None:
        """The head saw a change: requests waiting for the router look again."""
        if self.front is not None:
            self.front.changed()

    async def start(self, nursery: trio.Nursery) -> None:
        """Serve the front door in ``nursery`` (returns once it listens)."""
        sock = self.ctx.front_socket
        if self.front is None or sock is None:
            return
        await nursery.start(self.front.run, sock)
        self.ctx.log.info("head: the front door serves at %s", self.url)
