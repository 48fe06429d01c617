"""The head's benchmark stage: its client checked with the router's preflight, run once the job is
``ready``, and the job ended after it unless ``keep_serving`` (docs/benchmark.md).

The client runs through the head's launcher on the head's node (``client_placement: head``), or
under pyxis as a step on the last decode's node (``last_decode``; the process launcher starts
processes on its own node only, so there it runs on the head's and says so). Its log is
``J/logs/benchmark/benchmark.log``, its results ``J/benchmark/``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import msgspec

from agent.benchmark.runner import BenchmarkRun
from agent.benchmark.target import CLIENT_ENV_NAMES, BenchTarget, job_gpus
from agent.head.context import HeadContext
from agent.head.decisions import JobFailed
from agent.job.benchmark import (
    BenchmarkPlan,
    BenchmarkStatus,
    BenchmarkSummary,
    head_run,
    pending_block,
)
from agent.job.logfiles import log_path, make_log_dir
from agent.job.names import BENCHMARK_NAME, parse_agent_name
from agent.job.records import RendezvousRecord
from agent.job.urls import router_url
from agent.launch import Launcher, LaunchSpec, make_launcher
from agent.launch.commands import arg_value, benchmark_env


class BenchmarkStage:
    """One job's benchmark, owned by the head."""

    def __init__(
        self,
        ctx: HeadContext,
        plan: BenchmarkPlan,
        on_done: Callable[[BenchmarkSummary], None],
    ) -> None:
        self.ctx = ctx
        self.plan = plan
        self.on_done = on_done
        self.files = head_run(ctx.job.root)
        scratch = ctx.scratch_folder(BENCHMARK_NAME) if ctx.scratch_folder else None
        self.env = benchmark_env(ctx.plan, plan, scratch=scratch)
        self.run: BenchmarkRun | None = None
        self._unstarted = pending_block(plan)

    def status(self) -> BenchmarkStatus:
        """The ``benchmark`` block of status.json."""
        return self.run.status() if self.run is not None else self._unstarted

    @property
    def failed(self) -> bool:
        """Whether the verdict is failed (including a run that never started)."""
        return self.status().state == "failed"

    def _spec(
        self, name: str, argv: list[str], env: dict[str, str], image: str | None
    ) -> LaunchSpec:
        spec = self.ctx.launch_spec(name, argv, env, image)
        # The setup script belongs to the engine images; the client's values must win in its own.
        ours = {*self.plan.env, *self.plan.secret_env, *CLIENT_ENV_NAMES}
        return dataclasses.replace(
            spec,
            setup_script=None,
            container_env=tuple(sorted({*spec.container_env, *(k for k in ours if k in env)})),
        )

    def _make_run(
        self, launcher: Launcher, records: Mapping[str, RendezvousRecord]
    ) -> BenchmarkRun:
        ctx = self.ctx
        target = BenchTarget(
            router_url=router_url(ctx.identity.address, ctx.plan),
            model=ctx.plan.model,
            tokenizer=self.plan.tokenizer or arg_value(ctx.plan.router.args, "--model-path"),
            metrics_urls=tuple(r.metrics_url for r in records.values()),
            gpus=job_gpus(ctx.plan),
            job_dir=ctx.job.root,
        )
        return BenchmarkRun(
            self.plan,
            target,
            self.files,
            launcher=launcher,
            launch_spec=self._spec,
            env=self.env,
            log_path=log_path(ctx.job, BENCHMARK_NAME, plan=ctx.plan),
            log_max_bytes=ctx.plan.agent.log_max_bytes,
            log_backups=ctx.plan.agent.log_backups,
            log=ctx.log,
            on_change=ctx.on_change,
        )

    def _launcher(self, records: Mapping[str, RendezvousRecord]) -> Launcher:
        if self.plan.placement != "last_decode":
            return self.ctx.launcher
        decodes = sorted(
            (p[1], r.node)
            for name, r in records.items()
            if (p := parse_agent_name(name)) and p[0] == "decode"
        )
        if self.ctx.plan.launcher != "pyxis" or not decodes:
            self.ctx.log.warning(
                "head: client_placement last_decode needs the pyxis launcher (the process "
                "launcher starts processes on its own node): the benchmark runs on %s",
                self.ctx.identity.node,
            )
            return self.ctx.launcher
        node = decodes[-1][1]
        self.ctx.log.info("head: the benchmark client runs on %s (last decode)", node)
        return make_launcher("pyxis", slurm_job_id=self.ctx.identity.slurm_job_id, node=node)

    async def preflight(self) -> None:
        """Can the client run? Checked with the router's, before the long load (JobFailed)."""
        probe = self._make_run(self.ctx.launcher, {})
        problem = await probe.preflight()
        if problem is not None:
            node = self.ctx.identity.node
            raise JobFailed(
                f"benchmark preflight failed on {node} (the benchmark client): {problem}"
            )
        self.ctx.log.info("head: the benchmark client answers (%s)", " ".join(self.plan.program))

    async def run_when_ready(self, records: Mapping[str, RendezvousRecord]) -> None:
        """Run the benchmark now (the job is ready), then hand the summary to the head."""
        try:
            make_log_dir(self.ctx.job, BENCHMARK_NAME, self.ctx.plan)
        except OSError as exc:  # its log sink keeps trying; the benchmark runs all the same
            self.ctx.log.warning("head: cannot make the benchmark's log folder: %s", exc)
        self.run = self._make_run(self._launcher(records), records)
        self.ctx.log.info(
            "head: benchmark (%s) starting; results in %s, log %s",
            self.plan.type,
            self.files.root,
            self.run.log_path,
        )
        summary = await self.run.run()
        if not self.run.interrupted:  # a stop or a failing job ends it: the head knows already
            self.on_done(summary)

    async def stop(self, reason: str) -> None:
        """End a running benchmark (its verdict: failed, ``reason``) or mark an unstarted one."""
        if self.run is None:
            if self._unstarted.state == "pending":
                self._unstarted = msgspec.structs.replace(
                    self._unstarted,
                    state="failed",
                    error=f"not run: {reason}",
                    ended_at=time.time(),
                )
            return
        self.run.stop(reason)
        await self.run.done.wait()
