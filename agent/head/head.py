"""The head agent's job (prefill-0): gate on every worker, run the router, prove it, keep serving.

Flow: every record present and every worker healthy (seen over each peer's long-polled ``/status``,
not through the shared file system) -> router started at once -> router ``/health`` -> one canary
streaming chat per decode node at once (the router's ``/health`` proves nothing) -> ``ready``.
Then "degrade, don't die": a restarting engine makes the job ``degraded``; a decode that ends
``failed`` is dropped and the router restarted without it, and taken back (the router restarted
with it, proven again) once its agent reports it healthy again, at most ``agent.max_rejoins``
times; the job fails only when the prefill, the router, or every decode has failed. Ready means
proven, every time: after any engine or router restart the job stays ``degraded`` until canaries
through the router pass again.

``Head`` runs the parts in that order and owns the job's state; what it knows is gathered into a
``JobView`` each round and the decisions are taken on it (``agent.head.decisions``). A recipe with
a benchmark runs it once ready (``agent.head.benchstage``); a failed benchmark makes the head's
exit code 1, and unless ``keep_serving`` the benchmark's end ends the job.
"""

from __future__ import annotations

import time

import httpx
import msgspec
import trio

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.head.answers import Answers
from agent.head.benchstage import BenchmarkStage
from agent.head.canaries import Canary, run_canaries
from agent.head.context import HeadContext
from agent.head.decisions import (
    JobFailed,
    JobView,
    converting,
    failure_of,
    fatal,
    gate,
    held_out,
    last_healthy,
    proof_due,
    restart_marks,
    serving_state,
    startup_overrun,
    to_drop,
    to_rejoin,
    waiting_for,
)
from agent.head.frontdoor import FrontDoor
from agent.head.peers import Peers
from agent.head.pool import TRIAL_RETRY_S, Membership, PoolFile
from agent.head.router import Router
from agent.head.trial import prove_joining
from agent.job.benchmark import BenchmarkSummary
from agent.job.logfiles import log_path
from agent.job.names import HEAD_NAME, ROUTER_NAME, agent_names, agent_sort_key
from agent.job.records import EngineStatus, Gate, JobAgent, JobStatus, with_last_states
from agent.job.vocab import SERVING_STATES, JobState
from agent.node.jobend import end_job
from agent.node.servicenotes import Standing
from agent.node.statuswriter import StatusWriter, read_local_supervisor
from agent.node.supervisor import EngineSupervisor

GATE_POLL_S = 0.5  # re-evaluate at least this often while bringing the job up
# And while serving: every change wakes the head before that (a pending re-proof at its time), so
# this is a safety net; each wake costs a look at every agent.
SERVE_POLL_S = 5.0
PROOF_RETRY_S = 5.0  # after a failed re-proof (its whole canary budget spent), try again after this


class Head:
    """Gating, router and job state for one job; owned by prefill-0's node agent."""

    def __init__(self, ctx: HeadContext) -> None:
        self.ctx = ctx
        self.plan = ctx.plan
        self.log = ctx.log
        # The head itself first, then every decode (the listing order of status.json).
        self.expected = list(agent_names(1, self.plan.decode.workers))
        self.peers = Peers(
            self.expected,
            job=ctx.job,
            plan=ctx.plan,
            own_status=ctx.own_status,
            log=ctx.log,
            on_change=self.poke,
            fetch=ctx.peer_fetch,
        )
        self.router = Router(ctx, self.peers.records)
        # The job's one stable client address, in front of the router (agent.front).
        self.front = FrontDoor(ctx, self.router, lambda: self.router_url, self._pool_now)
        # Decodes the router no longer uses, with the failure that dropped each.
        self.dropped: dict[str, str] = {}
        # Decodes whose answers were wrong (agent.canary.verify): failed in the view.
        self.answers = Answers(ctx)
        # How often each decode was taken back once healthy again (bounded by agent.max_rejoins),
        # and the last word on it (taken back after what, or why it stays out).
        self.rejoins: dict[str, int] = {}
        self.rejoin_reason: dict[str, str] = {}
        self.state: JobState = "starting"
        self.why = "the head's own engine first (preflight, load)"  # the reason of ``state``
        self.error: str | None = None
        self.router_url: str | None = None  # shown while the router is ours to serve
        self.gate: Gate | None = None  # once the router's process runs after the gate
        self._gate_noted = False
        # Carried into every status.json: `stop` checks the supervisor by them.
        self.local_pid, self.local_started_at = read_local_supervisor(ctx.job)
        # The decode pool tilert-submit scale changes while the job serves (agent.head.pool).
        self.pool_file = PoolFile(ctx.job, self.plan.decode.workers, ctx.log)
        self.pool = Membership()
        self.started_at = time.time()
        self.status_file = StatusWriter(ctx.job, self._job_status, ctx.writes)
        # The benchmark run once ready; a summary here once it ended the job (keep_serving false).
        bench = self.plan.benchmark
        self.bench = (
            None
            if isinstance(bench, msgspec.UnsetType)
            else BenchmarkStage(ctx, bench, on_done=self._benchmark_done)
        )
        self.ended_by: BenchmarkSummary | None = None
        # Set once this node has stopped: status.json then shows every agent's last state.
        self.ended = False
        self._poke = trio.Event()
        self._stop = trio.Event()
        # Changes seen (pokes, and the head's own decisions), and the view built at that count.
        self._changes = 0
        self._viewed: tuple[tuple[int, object], JobView] | None = None
        # The restart marks (decisions.restart_marks) when a canary last passed: any restart
        # since then keeps the job degraded until a canary passes again.
        self.proven: dict[str, int] | None = None
        self._proving = False
        self._proof = ""  # where the next proof stands (shown in the degraded reason)
        self._next_proof_at = 0.0

    # ---- what the node agent uses ------------------------------------------------------------

    @property
    def router_supervisor(self) -> EngineSupervisor | None:
        """The router's supervisor once started (for the agent's metrics)."""
        return self.router.supervisor

    def router_status(self) -> EngineStatus | None:
        """The router's ``/status`` view once started."""
        return self.router.status()

    def poke(self) -> None:
        """Something changed: re-evaluate now."""
        self._changes += 1
        self._poke.set()
        self.front.changed()

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: drain and stop."""
        self._stop.set()
        self.poke()

    async def stop(self) -> None:
        """Stop the router (first, so no request meets a stopping worker)."""
        await self.router.stop()

    async def _wait(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self._poke.wait()
        self._poke = trio.Event()

    # ---- what the head knows -----------------------------------------------------------------

    def _view(self) -> JobView:
        """What the head knows now; built again only after a change (a poke, the head's own
        engine or the router changing, a decision of the head's own): with 1,024 agents a view
        costs milliseconds, and the gate loop and status.json each want one per pass."""
        mark = (self._changes, self.router.mark())
        if self._viewed is not None and self._viewed[0] == mark:
            return self._viewed[1]
        view = self._build_view()
        self._viewed = (mark, view)
        return view

    def _build_view(self) -> JobView:
        return JobView(
            agents={n: self._row(n) for n in self.expected},
            healthy_since=self.peers.healthy_since(),
            healthy_at={n: self._healthy_at(n) for n in self.expected},
            versions=self.peers.versions(),
            router=self.router.entry(self.peers.by_name[HEAD_NAME].record),
        )

    def _row(self, name: str) -> JobAgent:
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

    def _pool_now(self) -> tuple[str | None, tuple[tuple[str, int], ...]]:
        """For the front door: why the router's pool is not whole now (the head's engine or a
        decode in the router's list not healthy), or None; and every restart mark."""
        view = self._view()
        down = [
            f"{name} is {view.agents[name].state}"
            for name in (HEAD_NAME, *self.router.decodes)
            if name in view.agents and view.agents[name].state != "healthy"
        ]
        return "; ".join(down) or None, tuple(sorted(restart_marks(view).items()))

    def _healthy_at(self, name: str) -> float | None:
        status = self.ctx.own_status() if name == HEAD_NAME else self.peers.by_name[name].status
        return status.healthy_at if status is not None else None

    def _job_status(self) -> JobStatus:
        view = self._view()
        status = JobStatus(
            state=self.state,
            model=self.plan.model,
            router_url=self.router_url,
            front_url=self.front.url,
            front=self.front.summary(),
            slurm_job_id=self.ctx.identity.slurm_job_id,
            local_pid=self.local_pid,
            local_started_at=self.local_started_at,
            error=self.error,
            # The pool's members, then the decodes joining and leaving it.
            agents=[*view.agents.values(), *(self._row(n) for n in self._moving())],
            router=view.router,
            standins=[n for n in self.plan.standins if n != ROUTER_NAME or self.router.standin],
            benchmark=self.bench.status() if self.bench is not None else msgspec.UNSET,
            gate=self.gate if self.gate is not None else msgspec.UNSET,
            router_tokenize=self.ctx.pool.tokenize if self.ctx.pool is not None else None,
        )
        if self.ended:
            # The job has ended: no agent is shown serving for good (their last words may come
            # after the head's; under Slurm no one writes after it).
            return with_last_states(status, f"stopped with the job ({self.state})")
        return status

    def _on_records(self) -> None:
        self.status_file.write_targets(self.peers.records())
        self.poke()

    def _set_state(self, state: JobState, why: str) -> None:
        changed = (state, why) != (self.state, self.why)
        if state != self.state:
            self.log.info("head: job %s -> %s: %s", self.state, state, why)
        self.state, self.why = state, why
        self.status_file.write()
        self.ctx.figures.job_state = self.state
        if changed and self.ctx.on_state is not None:
            self.ctx.on_state()

    def standing(self) -> Standing:
        """Where the job stands, for systemd: ready once canaries proved it (``ready``, or
        ``degraded`` when a decode was dropped on the way: it serves), loading until then."""
        proven = self.proven is not None
        return Standing(
            status=f"job {self.state}: {self.why}",
            ready=proven and self.state in SERVING_STATES,
            loading=not proven and self.state in ("starting", "waiting"),
        )

    @staticmethod
    def _check_fatal(view: JobView) -> None:
        why = fatal(view)
        if why is not None:
            raise JobFailed(why)

    # ---- the job's life ----------------------------------------------------------------------

    async def _bring_up(self, nursery: trio.Nursery) -> bool:
        """Gate, router, canaries. False when a stop was requested first."""
        budget = max(self.plan.prefill.startup_budget_s, self.plan.decode.startup_budget_s)
        deadline = trio.current_time() + budget
        await self.router.preflight()
        if self.bench is not None:
            await self.bench.preflight()
        while True:
            if self._stop.is_set():
                return False
            if self.peers.refresh_own():
                self._changes += 1
            view = self._view()
            self._check_fatal(view)
            last = gate(view, trio.current_time())
            if last is not None:
                break  # status.json (an fsync) waits until the router runs
            missing = any(view.state(n) == "missing" for n in self.expected)
            self._set_state("starting" if missing else "waiting", waiting_for(view))
            if converting(view):
                # The startup budget counts from when the last conversion ends.
                deadline = max(deadline, trio.current_time() + budget)
            if trio.current_time() > deadline:
                raise JobFailed(startup_overrun(view, budget))
            await self._wait(GATE_POLL_S)
        for name in to_drop(view, self.dropped):
            self.dropped[name] = failure_of(view.agents[name])
        decodes = [n for n in view.decodes if n not in self.dropped]
        router = self.router.start(nursery, decodes)
        self._changes += 1  # the dropped decodes and the router's row
        decision_s = trio.current_time() - last
        self.ctx.figures.gate_latency_s = decision_s
        self.router_url = self.router.url
        while router.state != "healthy":
            if self._stop.is_set():
                return False
            self._note_gate(router, view, decision_s, decodes)
            self._check_fatal(self._view())
            await self._wait(GATE_POLL_S)
        self._note_gate(router, view, decision_s, decodes)
        marks = restart_marks(self._view())
        self.ctx.figures.canary_latency_s = await self._canaries(len(decodes))
        if await self._check_answers(decodes):
            view = self._view()
            self._check_fatal(view)  # no decode answers right: the job fails
            self._change_pool(view, to_drop(view, self.dropped), [])
        self.proven = marks
        self._set_state("degraded" if self.dropped else "ready", "canaries answered")
        url = self.front.url or self.router.url
        self.log.info(
            "READY: %s serving model %r at %s (front door; router %s, %d decode node(s)); "
            "try: curl -sN %s/v1/chat/completions "
            '-H \'Content-Type: application/json\' -d \'{"model": "%s", "stream": true, '
            '"messages": [{"role": "user", "content": "Hello"}]}\'',
            self.plan.name,
            self.plan.model,
            url,
            self.router.url,
            len(decodes),
            url,
            self.plan.model,
        )
        return True

    def _benchmark_done(self, summary: BenchmarkSummary) -> None:
        """The benchmark ended: the job ends with it unless it keeps serving."""
        self.status_file.write()
        if self.bench is not None and not self.bench.plan.keep_serving:
            self.ended_by = summary
            self._stop.set()
            self.poke()

    def _note_gate(
        self, router: EngineSupervisor, view: JobView, decision_s: float, decodes: list[str]
    ) -> None:
        """Once the router's process runs: the gate users waited for, logged and in status.json."""
        if self._gate_noted or router.started_at is None:
            return
        self._gate_noted = True
        last = last_healthy(view)
        if last is not None:
            worker, healthy_at = last
            self.gate = Gate(
                last_worker=worker,
                last_healthy_at=healthy_at,
                router_started_at=router.started_at,
                gate_s=router.started_at - healthy_at,
                decision_s=decision_s,
            )
            self.ctx.figures.gate_s = self.gate.gate_s
        self.log.info(
            "head: every worker healthy; router started %.0f ms after the last one (%s; the head "
            "decided in %.1f ms; decodes %s)",
            (self.gate.gate_s if self.gate else decision_s) * 1000,
            self.gate.last_worker if self.gate else "?",
            decision_s * 1000,
            ", ".join(decodes),
        )
        self._set_state(
            "waiting", waiting_for(view) or "every worker healthy; the router starts, then canaries"
        )

    async def _canaries(self, count: int) -> list[float]:
        return await run_canaries(
            Canary.for_plan(self.plan, self.router.url),
            count,
            client=self.ctx.client,
            log=self.log,
            router_log=log_path(self.ctx.job, ROUTER_NAME, plan=self.ctx.plan),
        )

    async def _check_answers(self, names: list[str]) -> list[str]:
        """``agent.canary.verify`` on ``names``: those whose answers are wrong (failed now)."""
        wrong = await self.answers.check(names, self.peers.records(), restart_marks(self._view()))
        if wrong:
            self._changes += 1
            self.poke()
        return wrong

    async def _prove(self, marks: dict[str, int], count: int) -> None:
        """Canaries after a restart: the job is ``ready`` again only once they pass."""
        self.log.info(
            "head: every worker and the router healthy again; proving with %d canary(s)", count
        )
        self._proof = "healthy again; canary through the router running"
        try:
            latencies = await self._canaries(count)
            await self._check_answers(list(self.router.decodes))
        except JobFailed as exc:
            # Degrade, don't die: say why and try again.
            self._proof = f"healthy again, but the canary failed: {exc}"
            self._next_proof_at = trio.current_time() + PROOF_RETRY_S
            self.log.warning("head: re-proof failed; retrying in %gs: %s", PROOF_RETRY_S, exc)
        else:
            self.ctx.figures.canary_latency_s = latencies
            if restart_marks(self._view()) == marks:
                self.proven = marks
                self.log.info("head: canaries answered after the restart: serving again")
            self._proof = ""
        finally:
            self._proving = False
            self.poke()

    def _change_pool(self, view: JobView, newly: list[str], back: list[str]) -> None:
        """Drop the decodes that failed, take back those healthy again, restart the router."""
        limit = self.plan.agent.max_rejoins
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
        self._changes += 1  # the rows of the decodes dropped or taken back
        why = [f"without {', '.join(newly)}"] if newly else []
        why += [f"with {', '.join(back)} back"] if back else []
        self.router.use([n for n in view.decodes if n not in self.dropped], " and ".join(why))

    def _hold_out(self, view: JobView) -> None:
        """Say once why a dropped decode healthy again stays out (it flapped past its bound)."""
        for name, why in held_out(
            view, self.dropped, self.rejoins, self.plan.agent.max_rejoins
        ).items():
            if self.rejoin_reason.get(name) != why:
                self.rejoin_reason[name] = why
                self._changes += 1
                self.log.warning("head: %s: %s", name, why)

    # ---- the pool: tilert-submit scale (agent.head.pool) ---------------------------------------

    def _moving(self) -> list[str]:
        """The decodes joining or leaving the pool (not in the view: they do not make the job
        degraded)."""
        return sorted({*self.pool.joining, *self.pool.leaving}, key=agent_sort_key)

    def _members(self) -> list[str]:
        return [n for n in self.expected if n != HEAD_NAME]

    def _apply_pool(self, view: JobView, nursery: trio.Nursery) -> None:
        """Follow ``J/pool.json``: start joining the decodes it adds, take out those it removes,
        prove the joining ones once healthy, forget the leaving ones once their agents exited."""
        pool = self.pool
        wanted = self.pool_file.read()
        if wanted is not None:
            join, leave = pool.changes(wanted.names, self._members())
            for name in join:
                self.log.info("head: %s joins the pool (J/pool.json)", name)
                pool.joining[name] = time.time()
                self.peers.add(name)
            if leave:
                self._leave(view, leave, nursery)
        for name in list(pool.leaving):
            if self.peers.state(name) in ("stopped", "failed"):
                self.log.info("head: %s has left the pool", name)
                del pool.leaving[name]
        ready = [n for n in pool.joining if self.peers.state(n) == "healthy"]
        if ready and not pool.trying and trio.current_time() >= pool.retry_at:
            pool.trying = True
            nursery.start_soon(self._admit, ready)

    def _leave(self, view: JobView, names: list[str], nursery: trio.Nursery) -> None:
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
            self.router.use(
                [n for n in view.decodes if n in self.expected and n not in self.dropped],
                f"without {', '.join(members)} (leaving the pool)",
            )
        nursery.start_soon(self._send_leave, names)

    async def _send_leave(self, names: list[str]) -> None:
        """Once the router serves without them (bounded), ask each leaving agent to leave."""
        with trio.move_on_after(self.plan.router.startup_budget_s):
            while True:  # polled: the router's supervisor says its state to the node agent
                status = self.router.status()
                if status is None or status.state == "healthy":
                    break
                await trio.sleep(GATE_POLL_S / 5)
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
            wrong = await self._check_answers(names)
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
                self.router.use(
                    [n for n in self._members() if n not in self.dropped],
                    f"with {', '.join(joined)} joining the pool",
                )
        finally:
            pool.trying = False
            self.poke()

    async def _serve(self, nursery: trio.Nursery) -> None:
        """While serving: degrade, drop failed decodes, re-prove after restarts, fail only when
        nothing can serve."""
        while not self._stop.is_set():
            if self.peers.refresh_own():
                self._changes += 1
            view = self._view()
            self._check_fatal(view)
            newly = to_drop(view, self.dropped)
            back = to_rejoin(view, self.dropped, self.rejoins, self.plan.agent.max_rejoins)
            if newly or back:
                self._change_pool(view, newly, back)
                view = self._view()  # the router is restarting now
            out_after_s = self.plan.agent.down_decode_out_after_s
            due = self.router.follow_down(view, trio.current_time(), out_after_s)
            self._hold_out(view)
            self._apply_pool(view, nursery)
            if (
                proof_due(view, self.dropped, self.proven)
                and not self._proving
                and trio.current_time() >= self._next_proof_at
            ):
                self._proving = True
                live = [n for n in view.decodes if n not in self.dropped]
                nursery.start_soon(self._prove, restart_marks(view), len(live))
            proven = restart_marks(view) == self.proven
            self._set_state(*serving_state(view, self.dropped, proven=proven, proof=self._proof))
            retry = self._next_proof_at - trio.current_time()
            waits = [SERVE_POLL_S, *([retry] if retry > 0 else []), *([due] if due else [])]
            await self._wait(min(waits))

    async def run(self) -> int:
        """The head's whole life; returns the agent's exit code."""
        code = EXIT_OK
        async with trio.open_nursery() as nursery:
            await self.front.start(nursery)
            nursery.start_soon(self.peers.follow, self._on_records)
            nursery.start_soon(self.pool_file.watch, self.poke)
            nursery.start_soon(self.status_file.heartbeat)
            try:
                if await self._bring_up(nursery):
                    if self.bench is not None:
                        nursery.start_soon(self.bench.run_when_ready, self.peers.records())
                    await self._serve(nursery)
            except JobFailed as exc:
                self.error = str(exc)
                self.log.error("head: job failed: %s", exc)
                code = exc.exit_code
            why = "stopped on request"
            if self.bench is not None:
                code = await self._end_benchmark(self.bench, code)
                if self.ended_by is not None:
                    why = "the benchmark passed and keep_serving is false: the job ends"
            self.router_url = None
            # Failed is said at once (users read it while we drain); stopping only on request.
            self._set_state("failed" if self.error else "stopping", self.error or why)
            await self.ctx.stop_node()
            self.ended = True
            self._set_state("failed" if self.error else "stopped", self.error or why)
            nursery.cancel_scope.cancel()
        return code

    async def _end_benchmark(self, bench: BenchmarkStage, code: int) -> int:
        """Stop a benchmark still running, end the job if it ended it; the head's exit code."""
        reason = f"the job failed: {self.error}" if self.error else "stopped on request"
        await bench.stop(reason)
        self.status_file.write()
        verdict = bench.status()
        if self.ended_by is not None:
            if verdict.state == "failed" and not self.error:
                # The benchmark's own verdict fails the job; a stop that interrupted it does not.
                self.error = f"benchmark failed: {verdict.error}"
            why = "benchmark " + verdict.state + ("" if self.error else "; keep_serving is false")
            await end_job(self.ctx.identity, self.log, why)
        # Never a silent pass: a benchmark that did not pass makes the exit code non-zero.
        return EXIT_RUNTIME if code or verdict.state == "failed" else EXIT_OK
