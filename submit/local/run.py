"""``tilert-submit RECIPE --local``: the same agents as local processes, in the foreground.

``python -m submit.local.run J`` is what the submitter becomes once it has written the job
directory (``LocalBackend.submit`` execs it: same pid, no ``--set`` values on its command line):
it reads ``J/plan.json``, starts the agents, and watches the job until it fails, its head agent
exits, tilert-submit's own limit passes before ready, or a signal asks it to stop.

Agents start through the agent's own process launcher, so each has its own process group and dies
with this process even when it is SIGKILLed (PDEATHSIG and the lifeline); their engines die with
them the same way. A line is printed before and after each start, so a start that hangs shows.

Signals (docs/cli.md): SIGINT or SIGTERM stops every agent (each drains its engines), then exits
0. The same signal again within ``SAME_REQUEST_S`` is the same request (two ``stop`` commands at
once, a bouncing key); one after that, while the stop still runs, SIGKILLs every agent's process
group and exits 128+N (130 for SIGINT, 143 for SIGTERM). SIGUSR1 prints every thread's stack to
stderr (``faulthandler``): how to see where it is stuck.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import trio

from agent.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from agent.job.names import HEAD_NAME, agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan
from agent.job.pool import PoolFileError, read_pool
from agent.job.records import JobStatus, with_last_states
from agent.job.vocab import FINAL_STATES, Role
from agent.launch import LaunchSpec, ProcessHandle, make_launcher
from agent.launch.spec import exit_description
from agent.node.logpump import LogSink
from agent.problems import printable
from submit.local.backend import STOP_SIGNALS
from submit.local.timelimit import ends_at, limit_text

PROGRESS_EVERY_S = 10.0
POLL_S = 0.25
# A second stop signal this soon after the first is the same request, not an order to force it.
SAME_REQUEST_S = 1.0
# Before the head's own clock runs: the agents' Python start and imports on a loaded machine.
AGENT_START_S = 20.0


def agent_argv(job: JobDir, role: Role, index: int) -> list[str]:
    """How a local agent is started: this interpreter, so the demo needs nothing on PATH."""
    return [
        sys.executable,
        "-m",
        "agent.main",
        "--role",
        role,
        "--index",
        str(index),
        "--job-dir",
        str(job.root),
    ]


def submit_limit(plan: Plan) -> float:
    """How long tilert-submit waits for ready: all the head waits for, plus the agents' start."""
    workers = max(plan.prefill.startup_budget_s, plan.decode.startup_budget_s)
    # A canary is retried until its timeout, and its last request may take that long again.
    canaries = 2 * plan.agent.canary_timeout_s
    return workers + plan.router.startup_budget_s + canaries + AGENT_START_S


def _read(job: JobDir) -> JobStatus | None:
    try:
        return job.read_status()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _summary(status: JobStatus) -> str:
    return ", ".join(f"{a.name} {a.state}" for a in status.agents) or "no agent yet"


def _say(message: str) -> None:
    print(message, flush=True)


class LocalRun:
    """The foreground supervisor of one local job's agents."""

    def __init__(self, job: JobDir, plan: Plan) -> None:
        self.job = job
        self.plan = plan
        self.env = dict(os.environ)
        self.launcher = make_launcher("process", slurm_job_id=None, node=None)
        self.agents: dict[str, ProcessHandle] = {}
        self.sinks: dict[str, LogSink] = {}
        self.limit = submit_limit(plan)
        self.started = time.monotonic()
        # Ready is due by then; pushed back while a worker converts its weights (as the head does).
        self.deadline = self.started + self.limit
        # The agent whose exit ends the run: the head, or decode-0 of a convert job (no prefill).
        self.lead = HEAD_NAME if plan.prefill.nodes else agent_name("decode", 0)
        self.stop = trio.Event()
        self.first_signal_at: float | None = None
        # 128+N once a second signal forced the stop; the exit code then.
        self.forced: int | None = None
        self.stopping = trio.CancelScope()
        # Why the job failed when tilert-submit itself decided it (its limit, a dead head).
        self.failure: str | None = None
        # J/pool.json as last acted on (tilert-submit scale): its stat, and where agents start.
        self._pool_key: tuple[int, int, int] | None = None
        # The decode indexes of the pool as last acted on (the plan's until J/pool.json exists):
        # only an index a new pool adds is started; one already in the pool whose agent exited is
        # not ours to start again (it failed and was dropped, or was restarted elsewhere: two
        # agents under one name would fight over its record).
        self._pool_indexes: set[int] = set(range(plan.decode.workers))
        self._nursery: trio.Nursery | None = None
        # Set once slurm.time_limit's signal lead came (submit.local.timelimit): the job ends
        # because its time is up, and status.json's ended_by says so.
        self.timed_out = False

    async def _start(self, nursery: trio.Nursery, role: Role, index: int) -> None:
        name = agent_name(role, index)
        log_dir = self.job.log_dir(name)
        log_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(log_dir, 0o700)
        # The agent writes agent.log itself; its stderr is kept too, for crashes before logging.
        sink = LogSink(log_dir / "agent.stderr.log", max_bytes=8 * 1024 * 1024, backups=1)
        _say(f"starting {name} (log: {log_dir / 'agent.log'})")
        agent = await self.launcher.start(
            LaunchSpec(name=name, argv=agent_argv(self.job, role, index), env=self.env)
        )
        _say(f"{name} started: pid {agent.pid}")
        self.agents[name] = agent
        self.sinks[name] = sink
        nursery.start_soon(sink.pump, agent.output)
        # Reap it when it exits: ``returncode`` stays None until someone waits.
        nursery.start_soon(agent.wait)

    async def _stop_agents(self) -> None:
        # Each agent drains its engines within their graces; the plan's drain time bounds that.
        grace = self.plan.drain_s()
        with self.stopping:
            async with trio.open_nursery() as nursery:
                for agent in self.agents.values():
                    nursery.start_soon(agent.stop, grace)

    async def _on_signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            now = trio.current_time()
            if self.first_signal_at is None:
                self.first_signal_at = now
                _say(
                    f"{name} received: stopping every agent (another SIGINT or SIGTERM "
                    f"after {SAME_REQUEST_S:g}s kills them at once)"
                )
                self.stop.set()
            elif now - self.first_signal_at < SAME_REQUEST_S or self.forced is not None:
                continue  # the same request again
            else:
                self.forced = 128 + signum
                _say(f"{name} received again: killing every agent now")
                for agent in self.agents.values():
                    agent.kill()
                self.stopping.cancel()

    async def _time_limit(self) -> None:
        """slurm.time_limit as Slurm applies it: SIGTERM to every agent at the signal lead (they
        drain, as on a stop), every agent killed at the limit if any is still there."""
        status = _read(self.job)
        end = ends_at(self.plan, status.local_started_at if status else None)
        if end is None:
            return
        lead = self.plan.slurm.signal_lead_s
        _say(f"time limit: {limit_text(self.plan)}; the job ends by {time.ctime(end)}")
        # Wall-clock deadlines (what `status` and the service compute from local_started_at),
        # slept on trio's clock.
        await trio.sleep(max(0.0, end - lead - time.time()))
        if not self.stop.is_set():
            self.timed_out = True
            _say(f"time limit: {lead}s left, stopping every agent (SIGTERM, as Slurm's --signal)")
            self.stop.set()
        await trio.sleep(max(0.0, end - time.time()))
        if self.timed_out and self.forced is None:
            left = [name for name, agent in self.agents.items() if agent.returncode is None]
            if left:
                _say(f"time limit reached: killing {', '.join(left)}")
                for agent in self.agents.values():
                    agent.kill()
                self.stopping.cancel()

    async def run(self) -> int:
        """Start the agents, show progress, wait for a signal, a failure or the limit."""
        code = 0
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            # Held since status.json named this process (LocalBackend.claim): delivered now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._on_signals, signals)
                nursery.start_soon(self._time_limit)
                starts: list[tuple[Role, int]] = [
                    ("prefill", i) for i in range(self.plan.prefill.nodes)
                ]
                starts += [("decode", i) for i in range(self.plan.decode.workers)]
                for role, index in starts:
                    if not self.stop.is_set():
                        await self._start(nursery, role, index)
                if not self.stop.is_set():
                    what = (
                        f"waiting for the job to be ready (limit {self.limit:g}s)"
                        if self.lead == HEAD_NAME
                        else "converting the weights"
                    )
                    _say(
                        f"started {len(self.agents)} agent{'s' if len(self.agents) != 1 else ''} "
                        f"({', '.join(self.agents)}); {what}; Ctrl-C stops it"
                    )
                    code = await self._watch()
                await self._stop_agents()
                self._record_end()
                for sink in self.sinks.values():
                    sink.close()
                final = _read(self.job)
                _say(
                    f"job {final.state if final else 'unknown'}; "
                    f"logs: tilert-submit logs {self.job.root}"
                )
                nursery.cancel_scope.cancel()
        return self.forced or code

    def _record_end(self) -> None:
        """Say in status.json how the job ended when no agent could (all of them are gone now)."""
        status = _read(self.job)
        if status is None:
            return
        if self.failure is not None:
            # The head, stopped by us, wrote `stopped`: the job failed all the same.
            if status.state == "failed":
                return
            status.state, status.error = "failed", self.failure
            reason = "stopped: the job failed"
        elif self.timed_out:
            status.ended_by = "time_limit"
            status.state = "failed" if status.state == "failed" else "stopped"
            reason = f"stopped at the time limit ({limit_text(self.plan)})"
        elif status.state in FINAL_STATES:
            reason = f"stopped with the job ({status.state})"
        else:
            # Stopped (or killed) before the head wrote its last state, or before it started:
            # without this, status.json would read `pending` or `ready` for good.
            status.state = "stopped"
            reason = "stopped by tilert-submit" + (" (killed)" if self.forced else "")
        status = with_last_states(status, reason)
        status.router_url = status.front_url = None
        status.updated_at = time.time()
        self._write(status)

    def _write(self, status: JobStatus) -> None:
        """Write status.json; a full, read-only or removed job directory is said, not raised."""
        try:
            self.job.write_status(status)
        except OSError as exc:
            _say(f"cannot write {self.job.status}: {exc.strerror or exc}")

    async def _watch(self) -> int:
        last_line = ""
        last_print = 0.0
        ready_said = False
        lead = self.agents[self.lead]
        # A convert job ends when its conversion does: no ready, and no limit of ours.
        serving = self.lead == HEAD_NAME
        while not self.stop.is_set():
            status = _read(self.job)
            elapsed = time.monotonic() - self.started
            if status is not None:
                if status.state in ("ready", "degraded") and not ready_said:
                    ready_said = True
                    self._say_ready(status, elapsed)
                elif status.state == "failed":
                    _say(f"job failed: {printable(status.error or 'no reason given')}")
                    return 1
                line = f"{status.state}: {_summary(status)}"
                now = time.monotonic()
                if line != last_line or (not ready_said and now - last_print > PROGRESS_EVERY_S):
                    limit = f" / limit {self.limit:g}s" if serving and not ready_said else ""
                    _say(f"[{elapsed:6.1f}s{limit}] {line}")
                    last_line, last_print = line, now
                if any(a.state == "converting" for a in status.agents):
                    self.deadline = max(self.deadline, now + self.limit)
            if lead.returncode is not None:
                return self._lead_exited(lead)
            if serving:
                await self._follow_pool()
            if serving and not ready_said and time.monotonic() > self.deadline:
                last = f"{status.state}: {_summary(status)}" if status else "no status.json"
                self.failure = (
                    f"not ready within tilert-submit's limit of {self.limit:g}s (the startup, "
                    f"router and canary budgets plus {AGENT_START_S:g}s to start the agents); "
                    f"last seen: {last}"
                )
                _say(f"job failed: {self.failure}; stopping every agent")
                return 1
            with trio.move_on_after(POLL_S):
                await self.stop.wait()
        return 0

    async def _follow_pool(self) -> None:
        """Start the decode agents ``J/pool.json`` adds (``tilert-submit scale``); the head takes
        them in once proven, and asks those it removes to leave (they exit 0 by themselves)."""
        try:
            st = os.stat(self.job.pool)
        except OSError:
            return
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._pool_key or self._nursery is None:
            return
        self._pool_key = key
        try:
            pool = read_pool(self.job, self.plan.decode.workers)
        except (OSError, PoolFileError) as exc:
            _say(f"cannot use {self.job.pool}: {exc}; the pool stays as it is")
            return
        before, self._pool_indexes = self._pool_indexes, set(pool.decode)
        for index in sorted(pool.decode):
            agent = self.agents.get(agent_name("decode", index))
            added = index not in before
            if added and (agent is None or agent.returncode is not None):
                await self._start(self._nursery, "decode", index)

    @staticmethod
    def _benchmark_ended(status: JobStatus | None) -> bool:
        """Whether the head ended the job by itself (a benchmark with keep_serving false)."""
        if status is None or status.state != "stopped" or not status.benchmark:
            return False
        _say(
            f"job stopped: its benchmark {status.benchmark.state} (see {status.benchmark.summary})"
        )
        return True

    def _lead_exited(self, lead: ProcessHandle) -> int:
        """The lead agent (the head; a convert job's decode-0) has exited: say how, and make
        status.json say it when the agent could not."""
        code = lead.returncode or 0
        status = _read(self.job)
        if not code and (self.lead != HEAD_NAME or self._benchmark_ended(status)):
            return 0  # a convert job that finished, or a job its benchmark ended
        how = exit_description(code)
        who = f"the head agent {HEAD_NAME}" if self.lead == HEAD_NAME else self.lead
        agent_log = self.job.log_dir(self.lead) / "agent.log"
        error = status.error if status and status.error else f"see {agent_log}"
        _say(f"{who} {how}: {printable(error)}")
        tail = self.sinks[self.lead].recent(20)
        if tail:
            _say("last lines of its stderr:\n  " + "\n  ".join(printable(line) for line in tail))
        if code and status is not None and status.state != "failed":
            # It died before it could say so (killed, crashed): the last line of its stderr is no
            # cause (it may be any agent's progress line), the exit is. Say it at once.
            self.failure = f"{who} {how} before it could say why (log: {agent_log})"
            status.state, status.error = "failed", self.failure
            status.router_url = status.front_url = None
            status.updated_at = time.time()
            for row in status.agents:
                if row.name == self.lead:
                    row.state, row.reason = "failed", self.failure
            if status.router is not None:
                # The router is the head's child and ends with it.
                status.router.state = "failed"
                status.router.reason = f"ended with {who}"
            self._write(status)
        return 1 if code else 0

    def _say_ready(self, status: JobStatus, elapsed: float) -> None:
        url = status.front_url or status.router_url
        _say(
            f"READY after {elapsed:.1f}s: {status.state}, model {status.model!r} at {url}"
            f" (front door; router {status.router_url})\n"
            f"  try: curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{status.model}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hello"}}]}}\'\n'
            f"  status: tilert-submit status {self.job.root}    logs: tilert-submit logs "
            f"{self.job.root} -f"
        )


def _held(signum: int, frame: object) -> None:
    """Outside trio's receiver a stop signal changes nothing: the stop is already under way."""


def run_local(job: JobDir, plan: Plan) -> int:
    """Run a job's agents locally until ready, then until SIGINT/SIGTERM; the exit code."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Not SIG_IGN, which would discard a signal held since LocalBackend.claim. Not the defaults
    # either: trio redelivers a signal its receiver got but nobody read when the receiver closes,
    # and the default action would end this process with 143 before its last line.
    for signum in STOP_SIGNALS:
        signal.signal(signum, _held)
    code = trio.run(LocalRun(job, plan).run)
    # The stop is done. Python puts the default action back while it shuts down, so a late
    # `stop` (one that read status.json before it said stopping) would turn exit 0 into 143.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m submit.local.run J``: supervise the written job J (exec'd by the submitter)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m submit.local.run JOB_DIR (tilert-submit --local runs it)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    job = JobDir(Path(args[0]))
    try:
        plan = load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"tilert-submit: {job.plan}: cannot read the plan: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return run_local(job, plan)


if __name__ == "__main__":
    sys.exit(main())
