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
``JobView`` each round and the decisions are taken on it (``agent.head.decisions``); the decodes
and every change of the router's list are the ``PoolKeeper``'s (``agent.head.poolkeeper``), the
canaries that make the job ready the ``Proof``'s (``agent.head.proof``). A recipe with
a benchmark runs it once ready (``agent.head.benchstage``); a failed benchmark makes the head's
exit code 1, and unless ``keep_serving`` the benchmark's end ends the job.
"""

from __future__ import annotations

import msgspec
import trio

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.head.benchstage import BenchmarkStage
from agent.head.context import HeadContext
from agent.head.decisions import (
    JobFailed,
    JobView,
    converting,
    fatal,
    gate,
    last_healthy,
    restart_marks,
    serving_state,
    startup_overrun,
    waiting_for,
)
from agent.head.frontdoor import FrontDoor
from agent.head.peers import Peers
from agent.head.poolkeeper import PoolKeeper
from agent.head.proof import Proof
from agent.head.router import Router
from agent.job.benchmark import BenchmarkSummary
from agent.job.names import HEAD_NAME, ROUTER_NAME, agent_names
from agent.job.records import Gate, JobStatus, with_last_states
from agent.job.vocab import SERVING_STATES, JobState
from agent.node.jobend import end_job
from agent.node.servicenotes import Standing
from agent.node.statuswriter import StatusWriter, read_local_supervisor
from agent.node.supervisor import EngineSupervisor

GATE_POLL_S = 0.5  # re-evaluate at least this often while bringing the job up
# And while serving: every change wakes the head before that (a pending re-proof at its time), so
# this is a safety net; each wake costs a look at every agent.
SERVE_POLL_S = 5.0


class Head:
    """Gating, router and job state for one job; owned by prefill-0's node agent."""

    def __init__(self, ctx: HeadContext) -> None:
        self.ctx = ctx
        self.plan = ctx.plan
        self.log = ctx.log
        self.peers = Peers(
            list(agent_names(1, self.plan.decode.workers)),
            job=ctx.job,
            plan=ctx.plan,
            own_status=ctx.own_status,
            log=ctx.log,
            on_change=self.poke,
            fetch=ctx.peer_fetch,
        )
        self.router = Router(ctx, self.peers.records)
        # The decodes and the router's list: every change of them (agent.head.poolkeeper).
        self.keeper = PoolKeeper(ctx, self.router, self.peers, self.poke)
        # The job's one stable client address, in front of the router (agent.front).
        self.front = FrontDoor(ctx, self.router, lambda: self.router_url, self._pool_now)
        self.state: JobState = "starting"
        self.why = "the head's own engine first (preflight, load)"  # the reason of ``state``
        self.error: str | None = None
        self.router_url: str | None = None  # shown while the router is ours to serve
        self.gate: Gate | None = None  # once the router's process runs after the gate
        self._gate_noted = False
        # Carried into every status.json: `stop` checks the supervisor by them.
        self.local_pid, self.local_started_at = read_local_supervisor(ctx.job)
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
        self._viewed: tuple[tuple[int, int, object], JobView] | None = None
        # Ready means proven: canaries through the router (agent.head.proof).
        # Each canary and answer check holds a front slot; the answers are the keeper's to judge.
        self.proof = Proof(
            ctx,
            self.router.url,
            self._view,
            self.poke,
            self.front.canary_slot,
            self.keeper.check_answers,
        )

    @property
    def dropped(self) -> dict[str, str]:
        """The decodes the router no longer uses, with the failure that dropped each."""
        return self.keeper.dropped

    # ---- what the node agent uses ------------------------------------------------------------

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
        engine or the router changing, a change of the pool): with 1,024 agents a view costs
        milliseconds, and the gate loop and status.json each want one per pass."""
        mark = (self._changes, self.keeper.version, self.router.mark())
        if self._viewed is not None and self._viewed[0] == mark:
            return self._viewed[1]
        expected = self.keeper.expected
        view = JobView(
            agents={n: self.keeper.row(n) for n in expected},
            healthy_since=self.peers.healthy_since(),
            healthy_at={n: self.peers.healthy_at(n) for n in expected},
            versions=self.peers.versions(),
            router=self.router.entry(self.peers.by_name[HEAD_NAME].record),
        )
        self._viewed = (mark, view)
        return view

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
            agents=[*view.agents.values(), *(self.keeper.row(n) for n in self.keeper.moving())],
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
        proven = self.proof.proven is not None
        return Standing(
            status=f"job {self.state}: {self.why}",
            ready=proven and self.state in SERVING_STATES,
            loading=not proven and self.state in ("starting", "waiting"),
        )

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
            _check_fatal(view)
            last = gate(view, trio.current_time())
            if last is not None:
                break  # status.json (an fsync) waits until the router runs
            missing = any(a.state == "missing" for a in view.agents.values())
            self._set_state("starting" if missing else "waiting", waiting_for(view))
            if converting(view):
                # The startup budget counts from when the last conversion ends.
                deadline = max(deadline, trio.current_time() + budget)
            if trio.current_time() > deadline:
                raise JobFailed(startup_overrun(view, budget))
            await self._wait(GATE_POLL_S)
        decodes = self.keeper.first_list(view)
        router = self.router.start(nursery, decodes)
        decision_s = trio.current_time() - last
        self.ctx.figures.gate_latency_s = decision_s
        self.router_url = self.router.url
        while router.state != "healthy":
            if self._stop.is_set():
                return False
            self._note_gate(router, view, decision_s, decodes)
            _check_fatal(self._view())
            await self._wait(GATE_POLL_S)
        self._note_gate(router, view, decision_s, decodes)
        marks = restart_marks(self._view())
        self.ctx.figures.canary_latency_s = await self.proof.canaries(len(decodes))
        if await self.proof.answers(decodes):
            view = self._view()
            _check_fatal(view)  # no decode answers right: the job fails
            self.keeper.drop_and_rejoin(view)  # the wrong ones out of the router's list
        self.proof.proven = marks
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

    async def _serve(self, nursery: trio.Nursery) -> None:
        """While serving: degrade, drop failed decodes, re-prove after restarts, fail only when
        nothing can serve."""
        keeper, proof = self.keeper, self.proof
        while not self._stop.is_set():
            if self.peers.refresh_own():
                self._changes += 1
            view = self._view()
            _check_fatal(view)
            if keeper.drop_and_rejoin(view):
                view = self._view()  # the router is restarting now
            out_after_s = self.plan.agent.down_decode_out_after_s
            due = keeper.follow_down(view, trio.current_time(), out_after_s)
            keeper.hold_out(view)
            keeper.apply_file(nursery)
            proof.start_if_due(view, keeper.dropped, nursery)
            proven = restart_marks(view) == proof.proven
            self._set_state(*serving_state(view, keeper.dropped, proven=proven, proof=proof.where))
            retry = proof.next_at - trio.current_time()
            waits = [SERVE_POLL_S, *([retry] if retry > 0 else []), *([due] if due else [])]
            await self._wait(min(waits))

    async def run(self) -> int:
        """The head's whole life; returns the agent's exit code."""
        code = EXIT_OK
        async with trio.open_nursery() as nursery:
            await self.front.start(nursery)
            nursery.start_soon(self.peers.follow, self._on_records)
            nursery.start_soon(self.keeper.pool_file.watch, self.poke)
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


def _check_fatal(view: JobView) -> None:
    why = fatal(view)
    if why is not None:
        raise JobFailed(why)
