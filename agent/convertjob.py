"""The agent of a ``tilert-submit convert`` job: convert the weights folder, then end.

A convert job's plan holds one decode agent and no prefill (agent.recipe.convertplan). Its agent
runs the same ``WeightsGate`` a serving decode agent runs before its engine (the same check, the
same lock, the same converter through the same launcher), writes ``J/status.json`` itself (there
is no head), and exits: 0 when the folder is complete (``stopped``), 1 when it is not (``failed``),
0 after a requested stop.
"""

from __future__ import annotations

import logging
import signal

import msgspec
import trio

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.job.logfiles import convert_log_path
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import JobAgent, JobStatus
from agent.job.vocab import AgentState, JobState
from agent.launch import make_launcher
from agent.launch.jobspecs import JobSpecs
from agent.launch.scratch import scratch_root
from agent.node.conversion import WeightsGate
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites
from agent.node.statuswriter import StatusWriter, read_local_supervisor


class ConvertJob:
    """One node converting one weights folder for a convert job."""

    def __init__(self, *, job: JobDir, plan: Plan, identity: Identity, log: logging.Logger) -> None:
        self.job = job
        self.plan = plan
        self.id = identity
        self.log = log
        # The launcher and launch specs a node agent would use (mounts, image settings); no engine.
        launcher = make_launcher(
            plan.launcher, slurm_job_id=identity.slurm_job_id, node=identity.node
        )
        self.gate = WeightsGate(
            plan=plan,
            job=job,
            identity=identity,
            launcher=launcher,
            launch_spec=JobSpecs(plan, scratch_root=scratch_root(job, plan.agent.scratch_dir)),
            log=log,
            on_change=self._changed,
        )
        self.state: JobState = "starting"
        self.agent_state: AgentState = "starting"
        self.reason = "checking the weights folder"
        self.error: str | None = None
        # Carried into every status.json: `stop` checks the supervisor by them.
        self.local_pid, self.local_started_at = read_local_supervisor(job)
        # Its writes of status.json: a failed one is logged (no /status shows it: no endpoint).
        writes = JobWrites(log, on_change=lambda: None)
        self.status_file = StatusWriter(job, self._job_status, writes)

    def _changed(self) -> None:
        self.status_file.write()

    def _job_status(self) -> JobStatus:
        """``status.json``: the job and its one agent."""
        # The gate's state while it works, and its failure; once stopped, ours.
        gate = self.gate.status() if self.state == "starting" or self.gate.failure else None
        state, reason = (gate.state, gate.reason) if gate else (self.agent_state, self.reason)
        progress = self.gate.progress()
        agent = JobAgent(
            name=self.id.name,
            role=self.id.role,
            index=self.id.index,
            node=self.id.node,
            state=state,
            restarts=0,
            reason=reason,
            log=str(convert_log_path(self.job, self.id.name)),
            metrics_url=None,
            status_url=None,
            convert=progress if progress is not None else msgspec.UNSET,
        )
        return JobStatus(
            state=self.state,
            model=self.plan.model,
            slurm_job_id=self.id.slurm_job_id,
            local_pid=self.local_pid,
            local_started_at=self.local_started_at,
            error=self.error,
            agents=[agent],
        )

    async def run(self) -> int:
        """Convert (or find the folder complete); the exit code."""
        self.status_file.write()
        code = EXIT_OK
        ok = stopped = False
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.status_file.heartbeat)

                async def on_signal() -> None:
                    nonlocal stopped
                    async for signum in signals:
                        self.log.info(
                            "%s: %s received; stopping the conversion",
                            self.id.name,
                            signal.Signals(signum).name,
                        )
                        stopped = True
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal)
                ok = await self.gate.ready()
                nursery.cancel_scope.cancel()
        done = self.gate.done
        if stopped:
            self.state, self.agent_state = "stopped", "stopped"
            self.reason = "stopped on request before the weights folder was complete"
        elif ok and done is not None:
            self.state, self.agent_state = "stopped", "stopped"
            self.reason = f"weights complete: {done.shard_count} shards in {done.folder}"
        elif ok:
            self.state, self.agent_state = "stopped", "stopped"
            self.reason = "the decode has no model-weights-dir: nothing to convert"
        else:
            code = EXIT_RUNTIME
            self.state = "failed"
            self.error = f"{self.id.name} on {self.id.node}: {self.gate.failure}"
        self.log.info("%s: convert job %s: %s", self.id.name, self.state, self.error or self.reason)
        self.status_file.write()
        self.log.info("%s: exiting with code %d", self.id.name, code)
        return code
