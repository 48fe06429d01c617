"""``tilert-submit RECIPE --local``: the same agents as local processes, in the foreground.

Agents start through the agent's own process launcher, so each has its own process group and dies
with this process even when it is SIGKILLed (PR_SET_PDEATHSIG from the main thread); their engines
die with them the same way. Ctrl-C or SIGTERM stops everything and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import msgspec
import trio

from agent.job.names import HEAD_NAME, agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import JobStatus
from agent.launch import LaunchSpec, ProcessHandle, make_launcher
from agent.node.logpump import LogSink

PROGRESS_EVERY_S = 10.0
POLL_S = 0.25


def agent_argv(job: JobDir, role: str, index: int) -> list[str]:
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

    def __init__(self, job: JobDir, plan: Plan, extra_env: dict[str, str]) -> None:
        self.job = job
        self.plan = plan
        self.env = {**os.environ, **extra_env}
        self.launcher = make_launcher("process", slurm_job_id=None, node=None)
        self.agents: dict[str, ProcessHandle] = {}
        self.sinks: dict[str, LogSink] = {}
        self.limit = max(plan.prefill.startup_budget_s, plan.decode.startup_budget_s)
        self.started = time.monotonic()
        # The agent whose exit ends the run: the head, or decode-0 of a convert job (no prefill).
        self.lead = HEAD_NAME if plan.prefill.nodes else agent_name("decode", 0)

    async def _start(self, nursery: trio.Nursery, role: str, index: int) -> None:
        name = agent_name(role, index)
        log_dir = self.job.log_dir(name)
        log_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(log_dir, 0o700)
        # The agent writes agent.log itself; its stderr is kept too, for crashes before logging.
        sink = LogSink(log_dir / "agent.stderr.log", max_bytes=8 * 1024 * 1024, backups=1)
        engine = await self.launcher.start(
            LaunchSpec(name=name, argv=agent_argv(self.job, role, index), env=self.env)
        )
        self.agents[name] = engine
        self.sinks[name] = sink
        nursery.start_soon(sink.pump, engine.output)
        # Reap it when it exits: ``returncode`` stays None until someone waits.
        nursery.start_soon(engine.wait)

    async def _stop_agents(self) -> None:
        # Each agent drains its engines within their graces; the plan's drain time bounds that.
        grace = self.plan.drain_s()
        async with trio.open_nursery() as nursery:
            for engine in self.agents.values():
                nursery.start_soon(engine.stop, grace)

    async def run(self) -> int:
        """Start the agents, show progress, wait for a signal or a failure."""
        status = _read(self.job)
        if status is not None:
            status.local_pid = os.getpid()
            self.job.write_status(status)
        code = 0
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                for i in range(self.plan.prefill.nodes):
                    await self._start(nursery, "prefill", i)
                for i in range(self.plan.decode.workers):
                    await self._start(nursery, "decode", i)
                what = (
                    f"waiting for the job to be ready (limit {self.limit:g}s)"
                    if self.lead == HEAD_NAME
                    else "converting the weights"
                )
                _say(
                    f"started {len(self.agents)} agent{'s' if len(self.agents) != 1 else ''} "
                    f"({', '.join(self.agents)}); {what}; Ctrl-C stops it"
                )
                stop = trio.Event()

                async def on_signal() -> None:
                    async for signum in signals:
                        _say(f"{signal.Signals(signum).name} received: stopping every agent")
                        stop.set()
                        return

                nursery.start_soon(on_signal)
                code = await self._watch(stop)
                await self._stop_agents()
                for sink in self.sinks.values():
                    sink.close()
                nursery.cancel_scope.cancel()
        final = _read(self.job)
        _say(f"job {final.state if final else 'unknown'}; logs: tilert-submit logs {self.job.root}")
        return code

    async def _watch(self, stop: trio.Event) -> int:
        last_line = ""
        last_print = 0.0
        ready_said = False
        head = self.agents[self.lead]
        while not stop.is_set():
            status = _read(self.job)
            elapsed = time.monotonic() - self.started
            if status is not None:
                if status.state in ("ready", "degraded") and not ready_said:
                    ready_said = True
                    self._say_ready(status, elapsed)
                elif status.state == "failed":
                    _say(f"job failed: {status.error}")
                    return 1
                line = f"{status.state}: {_summary(status)}"
                now = time.monotonic()
                if line != last_line or (not ready_said and now - last_print > PROGRESS_EVERY_S):
                    serving = self.lead == HEAD_NAME and not ready_said
                    limit = f" / limit {self.limit:g}s" if serving else ""
                    _say(f"[{elapsed:6.1f}s{limit}] {line}")
                    last_line, last_print = line, now
            if head.returncode is not None:
                status = _read(self.job)
                error = status.error if status and status.error else "see its agent.log"
                if not head.returncode and (self.lead != HEAD_NAME or self._ended(status)):
                    return 0  # a convert job that finished, or a job its benchmark ended
                who = "the head agent prefill-0" if self.lead == HEAD_NAME else self.lead
                _say(f"{who} exited with code {head.returncode}: {error}")
                tail = self.sinks[self.lead].recent(20)
                if tail:
                    _say("last lines of its stderr:\n  " + "\n  ".join(tail))
                if head.returncode and status is not None and status.state != "failed":
                    # It died before it could say so (e.g. the router port was taken).
                    last = tail[-1] if tail else "see its agent.log"
                    status.state = "failed"
                    status.error = (
                        f"{self.lead} exited with code {head.returncode}: {last} "
                        f"(log: {self.job.log_dir(self.lead) / 'agent.log'})"
                    )
                    status.router_url = None
                    status.updated_at = time.time()
                    self.job.write_status(status)
                return 1 if head.returncode else 0
            with trio.move_on_after(POLL_S):
                await stop.wait()
        return 0

    @staticmethod
    def _ended(status: JobStatus | None) -> bool:
        """Whether the head ended the job by itself (a benchmark with keep_serving false)."""
        if status is None or status.state != "stopped" or not status.benchmark:
            return False
        _say(
            f"job stopped: its benchmark {status.benchmark.state} (see {status.benchmark.summary})"
        )
        return True

    def _say_ready(self, status: JobStatus, elapsed: float) -> None:
        url = status.router_url
        _say(
            f"READY after {elapsed:.1f}s: {status.state}, model {status.model!r} at {url}\n"
            f"  try: curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{status.model}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hello"}}]}}\'\n'
            f"  status: tilert-submit status {self.job.root}    logs: tilert-submit logs "
            f"{self.job.root} -f"
        )


def run_local(job: JobDir, plan: Plan, extra_env: dict[str, str] | None = None) -> int:
    """Run a job's agents locally until ready, then until SIGINT/SIGTERM; the exit code."""
    return trio.run(LocalRun(job, plan, extra_env or {}).run)
