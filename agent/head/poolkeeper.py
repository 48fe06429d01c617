"""The decode pool's one owner: who is a member, who was dropped, who rests, who joins or leaves,
and every change of the router's decode list that follows from it.

Three kinds of change reach the router's list, each decided by a pure function of
``agent.head.decisions`` over a ``JobView`` and carried out here, in this order at every look of
the serving head: a decode that failed is dropped and one healthy again taken back (``to_drop``,
``to_rejoin``, bounded by ``agent.max_rejoins``: ``held_out``); a decode down for
``agent.down_decode_out_after_s`` rests out of the list until healthy again (``to_rest``,
``to_wake``); ``tilert-submit scale`` adds decodes (joining: proven through a trial router,
``agent.head.trial``, then members) and removes them (leaving: out of the list, then asked to
leave). The list itself is ``decisions.router_list`` of the members, the dropped and the
resting; the ``Router`` is handed it and restarts (a hand-over) only when it differs.

A decode whose answers were found wrong (``agent.canary.verify``: ``agent.head.answers``, asked
by the ``Proof`` after its canaries and here for a joining decode) is ``failed`` in its row until
its engine restarts, so it is dropped like any failed decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext

import httpx
import trio

from agent.head.answers import Answers
from agent.head.context import HeadContext
from agent.head.decisions import (
    JobFailed,
    JobView,
    down_decodes,
    failure_of,
    held_out,
    router_list,
    to_drop,
    to_rejoin,
    to_rest,
    to_wake,
)
from agent.head.peers import Peers
from agent.head.pool import TRIAL_RETRY_S, Membership, PoolFile
from agent.head.router import Router
from agent.head.trial import prove_joining
from agent.job.names import HEAD_NAME, agent_names, agent_sort_key
from agent.job.records import JobAgent

# How often the leaving decodes' wait looks at the router's state (its supervisor says it to the
# node agent; nothing wakes this wait).
LEAVE_POLL_S = 0.1


class PoolKeeper:
    """The job's decodes and the router's list, changed only here; owned by the head."""

    def __init__(
        self, ctx: HeadContext, router: Router, peers: Peers, poke: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self.router = router
        self.peers = peers
        self.poke = poke
        self.log = ctx.log
        self.max_rejoins = ctx.plan.agent.max_rejoins
        # The head itself first, then every member decode (the listing order of status.json).
        self.expected = list(agent_names(1, ctx.plan.decode.workers))
        # Decodes the router no longer uses, with the failure that dropped each.
        self.dropped: dict[str, str] = {}
        # How often each decode was taken back once healthy again (bounded by agent.max_rejoins),
        # and the last word on it (taken back after what, or why it stays out).
        self.rejoins: dict[str, int] = {}
        self.rejoin_reason: dict[str, str] = {}
        # Decodes out of the router's list while their engine is down, and when each decode of
        # the list was first seen down (trio's clock), while it is.
        self.resting: set[str] = set()
        self.down_since: dict[str, float] = {}
        # The decode pool tilert-submit scale changes while the job serves (agent.head.pool).
        self.pool_file = PoolFile(ctx.job, ctx.plan.decode.workers, ctx.log)
        self.pool = Membership()
        # Decodes whose answers were wrong (agent.canary.verify): failed in their rows.
        self.answers = Answers(ctx)
        self.started_at = time.time()
        # Bumped at every change of the rows above: the head's view is built again after one.
        self.version = 0

    # ---- what the head reads -----------------------------------------------------------------

    def members(self) -> list[str]:
        """The member decodes, in listing order (dropped or resting ones included)."""
        return [n for n in self.expected if n != HEAD_NAME]

    def wanted(self) -> list[str]:
        """The decodes the router's list holds when none rests."""
        return router_list(self.members(), self.dropped, ())

    def decodes(self) -> list[str]:
        """The router's decode list as decided now (``decisions.router_list``)."""
        return router_list(self.members(), self.dropped, self.resting)

    def moving(self) -> list[str]:
        """The decodes joining or leaving the pool (not in the view: they do not make the job
        degraded)."""
        return sorted({*self.pool.joining, *self.pool.leaving}, key=agent_sort_key)

    def row(self, name: str) -> JobAgent:
        """The status.json row of ``name``, with its rejoins once it was dropped and, for a
        decode, its place in the pool."""
        row = self.peers.entry(name, self.dropped.get(name))
        if name in self.rejoin_reason:
            row.rejoins = self.rejoins.get(name, 0)
            row.rejoin_reason = self.rejoin_reason[name]
        if row.role == "decode":
            pool = self.pool
            record = self.peers.by_name[name].record
            row.slurm_job_id = record.slurm_job_id if record else None
            if name in pool.joining:
                row.pool, row.pool_since = "joining", pool.joining[name]
                row.reason = f"joining the pool: {pool.note.get(name) or row.reason}"
            elif name in pool.leaving:
                row.pool, row.pool_since = "leaving", pool.leaving[name]
                row.reason = f"leaving the pool: {row.reason}"
            else:
                row.pool, row.pool_since = "member", pool.member_since.get(name, self.started_at)
            self.answers.mark(row)
        return row

    async def check_answers(
        self,
        names: Sequence[str] | None = None,
        gate: Callable[[], AbstractAsyncContextManager[object]] = nullcontext,
    ) -> list[str]:
        """``agent.canary.verify`` on ``names`` (None: the router's list now), each check holding
        ``gate``; those found wrong, failed in their rows now (the next look drops them)."""
        names = list(self.router.decodes if names is None else names)
        restarts = {n: self.peers.entry(n).restarts for n in names if n in self.peers.by_name}
        wrong = await self.answers.check(names, self.peers.records(), restarts, gate)
        self.version += 1  # a verdict may have changed a row
        if wrong:
            self.poke()
        return wrong

    # ---- the changes -------------------------------------------------------------------------

    def first_list(self, view: JobView) -> list[str]:
        """Before the router starts: drop the decodes that failed; the list it starts with."""
        for name in to_drop(view, self.dropped):
            self.dropped[name] = failure_of(view.agents[name])
        self.version += 1  # the dropped decodes' rows
        return self.decodes()

    def drop_and_rejoin(self, view: JobView) -> bool:
        """Drop the decodes that failed, take back those healthy again (a new list, a hand-over);
        whether anything changed."""
        newly = to_drop(view, self.dropped)
        back = to_rejoin(view, self.dropped, self.rejoins, self.max_rejoins)
        if not newly and not back:
            return False
        limit = self.max_rejoins
        for name in newly:
            self.dropped[name] = failure_of(view.agents[name])
            self.log.warning("head: dropping %s from the router", self.dropped[name])
        for name in back:
            failure = self.dropped.pop(name)
            count = self.rejoins[name] = self.rejoins.get(name, 0) + 1
            self.rejoin_reason[name] = (
                f"taken back into the router (rejoin {count} of at most {limit}, "
                f"agent.max_rejoins) after: {failure}"
            )
            self.log.warning(
                "head: %s is healthy again: taking it back into the router (rejoin %d of at most "
                "%d); it had been dropped after: %s",
                name,
                count,
                limit,
                failure,
            )
        why = [f"without {', '.join(newly)}"] if newly else []
        why += [f"with {', '.join(back)} back"] if back else []
        self._use(" and ".join(why))
        return True

    def hold_out(self, view: JobView) -> None:
        """Say once why a dropped decode healthy again stays out (it flapped past its bound)."""
        for name, why in held_out(view, self.dropped, self.rejoins, self.max_rejoins).items():
            if self.rejoin_reason.get(name) != why:
                self.rejoin_reason[name] = why
                self.version += 1
                self.log.warning("head: %s: %s", name, why)

    def follow_down(self, view: JobView, now: float, after_s: float | None) -> float | None:
        """Take out of the list the decodes down for ``after_s`` (agent.down_decode_out_after_s;
        None: never) and put back those healthy again; the seconds until the next one is due."""
        self.down_since = {
            n: self.down_since.get(n, now) for n in down_decodes(view, self.wanted())
        }
        out = to_rest(self.down_since, self.decodes(), now, after_s)
        back = to_wake(view, self.resting)
        if out or back:
            for name in out:
                self.log.warning(
                    "head: %s is %s: out of the router's list until it is healthy again "
                    "(down for %.1fs; agent.down_decode_out_after_s)",
                    name,
                    view.state(name),
                    now - self.down_since[name],
                )
            for name in back:
                self.log.info("head: %s is healthy again: back in the router's list", name)
            why = [f"without {', '.join(out)} (down)"] if out else []
            why += [f"with {', '.join(back)} (healthy again)"] if back else []
            # A hand-over, as for a dropped decode.
            self.resting = (self.resting | set(out)) - set(back)
            self.router.use(self.decodes(), " and ".join(why))
        if after_s is None:
            return None
        waiting = [s + after_s - now for n, s in self.down_since.items() if n not in self.resting]
        return max(0.0, min(waiting)) if waiting else None

    def _use(self, why: str) -> None:
        """Hand the router the list as it stands now (the rows changed: the view is stale)."""
        self.version += 1
        self.resting &= set(self.wanted())
        self.router.use(self.decodes(), why)

    # ---- the pool: tilert-submit scale (agent.head.pool) ---------------------------------------

    def apply_file(self, nursery: trio.Nursery) -> None:
        """Follow ``J/pool.json``: start joining the decodes it adds, take out those it removes,
        prove the joining ones once healthy, forget the leaving ones once their agents exited."""
        pool = self.pool
        wanted = self.pool_file.read()
        if wanted is not None:
            join, leave = pool.changes(wanted.names, self.members())
            for name in join:
                self.log.info("head: %s joins the pool (J/pool.json)", name)
                pool.joining[name] = time.time()
                self.peers.add(name)
            if leave:
                self._leave(leave, nursery)
        for name in list(pool.leaving):
            if self.peers.state(name) in ("stopped", "failed"):
                self.log.info("head: %s has left the pool", name)
                del pool.leaving[name]
        ready = [n for n in pool.joining if self.peers.state(n) == "healthy"]
        if ready and not pool.trying and trio.current_time() >= pool.retry_at:
            pool.trying = True
            nursery.start_soon(self._admit, ready)

    def _leave(self, names: list[str], nursery: trio.Nursery) -> None:
        """Take ``names`` out of the pool: out of the router's list first, then ask each agent
        to leave (it drains to idle, then stops)."""
        members = [n for n in names if n in self.expected]
        for name in names:
            self.pool.joining.pop(name, None)
            self.pool.leaving[name] = time.time()
            self.pool.member_since.pop(name, None)
        if members:
            for name in members:
                self.expected.remove(name)
                self.dropped.pop(name, None)
            self.log.info("head: %s leave(s) the pool: restarting the router without them", names)
            self._use(f"without {', '.join(members)} (leaving the pool)")
        nursery.start_soon(self._send_leave, names)

    async def _send_leave(self, names: list[str]) -> None:
        """Once the router serves without them (bounded), ask each leaving agent to leave."""
        with trio.move_on_after(self.ctx.plan.router.startup_budget_s):
            while True:  # polled: the router's supervisor says its state to the node agent
                status = self.router.status()
                if status is None or status.state == "healthy":
                    break
                await trio.sleep(LEAVE_POLL_S)
        token = await trio.to_thread.run_sync(self.ctx.job.read_token)
        for name in names:
            record = self.peers.by_name[name].record
            if record is None or not record.status_url:
                continue  # it never started: tilert-submit's supervisor stops it
            url = record.status_url.removesuffix("/status") + "/leave"
            try:
                response = await self.ctx.client.post(
                    url, headers={"Authorization": f"Bearer {token}"}, timeout=5.0
                )
                self.log.info("head: asked %s to leave: %s", name, response.text.strip()[:200])
            except httpx.HTTPError as exc:
                self.log.warning("head: cannot ask %s to leave at %s: %s", name, url, exc)

    async def _admit(self, names: list[str]) -> None:
        """Prove joining decodes through a trial router; only then restart the router with them."""
        pool = self.pool
        try:
            await prove_joining(self.ctx, self.peers.records(), names, standin=self.router.standin)
            # Not in the router's list yet: no client meets them, no front slot is held.
            wrong = await self.check_answers(names)
            if wrong:
                raise JobFailed(f"the answers of {', '.join(wrong)} are wrong (see its reason)")
        except JobFailed as exc:
            for name in names:
                pool.note[name] = f"its canary through a trial router failed: {exc}"
            pool.retry_at = trio.current_time() + TRIAL_RETRY_S
            self.log.warning("head: %s not taken into the pool yet: %s", ", ".join(names), exc)
        else:
            joined = [n for n in names if n in pool.joining]
            for name in joined:
                del pool.joining[name]
                pool.note.pop(name, None)
                pool.member_since[name] = time.time()
                self.expected.append(name)
            self.expected.sort(key=agent_sort_key)
            if joined:
                self.log.info("head: %s proven: restarting the router with them", joined)
                self._use(f"with {', '.join(joined)} joining the pool")
        finally:
            pool.trying = False
            self.poke()
