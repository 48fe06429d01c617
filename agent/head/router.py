"""The job's router: checked before the gate, started once every live worker is healthy, restarted
(a hand-over) whenever the head hands it a new decode list (``agent.head.poolkeeper``).

It runs under an ``EngineSupervisor`` on the head's node, with its log in the head's folder. Each
(re)launch builds its command from the decodes' current records, so a decode that republished its
ports is reached on the new ones. Under ``--mock`` a router the node cannot import means the
stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import trio

from agent.facts import ROUTER_MODULE
from agent.head.context import HeadContext
from agent.head.decisions import JobFailed
from agent.head.starved import StarvedRouter
from agent.job.logfiles import log_path
from agent.job.names import ROUTER_NAME
from agent.job.records import EngineStatus, JobAgent, RendezvousRecord
from agent.job.urls import router_url
from agent.launch import LaunchSpec, preflight
from agent.launch.commands import DecodeEndpoint, arg_value, router_command
from agent.launch.enginechecks import flag_question, pin_problems, pinned
from agent.launch.engineflags import flag_refusals
from agent.node.leave import HANDOVER_DRAIN_S
from agent.node.logpump import LogSink
from agent.node.policy import policy_for
from agent.node.supervisor import EngineSupervisor


def decode_endpoints(
    records: Mapping[str, RendezvousRecord], names: list[str]
) -> list[DecodeEndpoint]:
    """The router's ``--decode`` entries for ``names``, from their current records."""
    return [
        DecodeEndpoint(r.address, r.ports["ctrl"], r.ports["http"])
        for r in (records[n] for n in names)
    ]


class Router:
    """The router of one job: its preflight, its supervisor and the decodes it serves through."""

    def __init__(
        self, ctx: HeadContext, records: Callable[[], Mapping[str, RendezvousRecord]]
    ) -> None:
        self.ctx = ctx
        self.records = records
        self.url = router_url(ctx.identity.address, ctx.plan)
        # The decode list the router was last handed (by agent.head.poolkeeper, which alone
        # decides it: decisions.router_list); its command is built from it.
        self.decodes: list[str] = []
        self.standin = False
        self.supervisor: EngineSupervisor | None = None
        self.starved: StarvedRouter | None = None

    async def preflight(self) -> None:
        """Can this node start the real router? Under --mock a missing one means the stand-in."""
        plan, log = self.ctx.plan, self.ctx.log
        router = plan.router
        paths = []
        model_path = arg_value(router.args, "--model-path") or ""
        if model_path.startswith("/"):
            paths.append(model_path)
        checks = preflight.PreflightChecks(
            python=router.python,
            modules=[ROUTER_MODULE],
            distributions=list(dict.fromkeys(["tilert", *pinned(plan)])),
            # The stand-ins need no setup; the script belongs to the real images.
            setup_script=None if plan.standin("router") else plan.setup_script,
            configs_dir=plan.configs_dir,
            paths=paths,
        )
        # The router's own environment (frontend env, PATH, PYTHONPATH), as it will run.
        env = router_command(
            plan, prefill_url="", decodes=[], host=self.ctx.identity.address, use_standin=False
        ).env
        base = self.ctx.launch_spec("router-preflight", [], env, router.image)
        result = await preflight.run_preflight(self.ctx.launcher, base, checks)
        node = self.ctx.identity.node
        if result.ok and not plan.standin("router"):
            # A job with stand-ins is a rehearsal: its router is not the image the pins name.
            pins = pin_problems(pinned(plan), result.versions, image=router.image, engine="router")
            if pins:
                raise JobFailed(f"router preflight failed on {node}: " + "; ".join(pins))
        if result.ok:
            log.info("head: the real TileRT router is importable by %s", router.python)
        elif plan.standin("router"):
            self.standin = True
            log.warning(
                "head: --mock and %s cannot start the real router (%s): using the router stand-in",
                router.python,
                "; ".join(result.problems),
            )
        else:
            raise JobFailed(
                f"router preflight failed on {node} (the router's environment): "
                + "; ".join(result.problems)
            )
        # The router's own flags, asked of the program that will run (docs/preflight.md).
        argv = router_command(
            plan, prefill_url="", decodes=[], host="", use_standin=self.standin
        ).argv
        if result.setup_script and not self.standin:
            base = replace(base, setup_script=Path(result.setup_script))
        refused = await flag_refusals(
            self.ctx.launcher,
            base,
            flag_question(plan, "router", argv, standin=self.standin),
            versions=result.versions,
            policy=plan.agent.preflight,
            log=log,
            who="head",
        )
        if refused:
            raise JobFailed(
                f"router preflight failed on {node} (engine flags, agent.preflight.engine_flags): "
                + "; ".join(refused)
            )

    def _build(self) -> LaunchSpec:
        cmd = router_command(
            self.ctx.plan,
            prefill_url=self.ctx.prefill_url(),
            decodes=decode_endpoints(self.records(), self.decodes),
            host=self.ctx.identity.address,
            use_standin=self.standin,
            scratch=self.ctx.scratch_folder(ROUTER_NAME) if self.ctx.scratch_folder else None,
        )
        return self.ctx.launch_spec(ROUTER_NAME, cmd.argv, cmd.env, self.ctx.plan.router.image)

    def start(self, nursery: trio.Nursery, decodes: list[str]) -> EngineSupervisor:
        """Start the router through ``decodes`` (its supervisor runs in ``nursery``)."""
        plan, ctx = self.ctx.plan, self.ctx
        self.decodes = decodes
        sink = LogSink(
            log_path(ctx.job, ROUTER_NAME, plan=ctx.plan),
            max_bytes=plan.agent.log_max_bytes,
            backups=plan.agent.log_backups,
        )
        if ctx.pool is not None:
            sink.watchers.append(ctx.pool.feed)  # the refusals it logs per decode
        figures = ctx.front_figures
        # Alive but too busy to answer /health is not dead (agent.head.starved).
        self.starved = StarvedRouter(
            lambda: self.url,
            timeout_s=plan.agent.probe_timeout_s,
            note=sink.note,
            in_flight=lambda: figures.in_flight if figures is not None else 0,
            log=ctx.log,
        )
        self.supervisor = EngineSupervisor(
            name=ROUTER_NAME,
            launcher=ctx.launcher,
            build=self._build,
            health_url=lambda: f"{self.url}/health",
            ports=lambda: {"http": plan.router.port},
            policy=policy_for(
                plan,
                startup_budget_s=plan.router.startup_budget_s,
                stop_grace_s=plan.router.stop_grace_s,
            ),
            sink=sink,
            log=ctx.log,
            on_change=ctx.on_change,
            observe_probe=ctx.probe_observer("router"),
            client=ctx.client,
            handover_drain_s=HANDOVER_DRAIN_S,
            where="router",
            patience=self.starved,
        )
        nursery.start_soon(self.supervisor.run)
        return self.supervisor

    def use(self, decodes: list[str], why: str) -> None:
        """Restart the router through ``decodes`` (a hand-over: the old router finishes its
        streams while the new one starts); none when the list's endpoints are the same (a decode
        that rested is then dropped: the router already runs without it)."""
        before = self._endpoints()
        self.decodes = decodes
        if self.supervisor is not None and self._endpoints() != before:
            self.supervisor.relaunch(f"restarting the router {why}", handover=True)

    def _endpoints(self) -> list[DecodeEndpoint]:
        return decode_endpoints(self.records(), self.decodes)

    def mark(self) -> tuple[str, int, str, int] | None:
        """What the router's row shows (state, restarts, reason, whole seconds starved); None
        before it starts."""
        sup = self.supervisor
        starved = self.starved.starved_for() if self.starved is not None else None
        seconds = -1 if starved is None else int(starved)
        return None if sup is None else (sup.state, sup.restarts, sup.reason, seconds)

    def status(self) -> EngineStatus | None:
        """The router's ``/status`` view; None before it starts."""
        return self.supervisor.status() if self.supervisor is not None else None

    def entry(self, head_record: RendezvousRecord | None) -> JobAgent | None:
        """The router's row in status.json (its URLs are the head agent's); None before it
        starts."""
        status = self.status()
        if status is None:
            return None
        reason = status.reason
        starved = self.starved.starved_for() if self.starved is not None else None
        if starved is not None and status.state == "healthy":
            reason += (
                f"; but starved for {starved:.0f}s: /health too slow under load while its event "
                "loop answers (not counted as a failure; tilert-submit diagnose)"
            )
        return JobAgent(
            name=ROUTER_NAME,
            role="router",
            index=0,
            node=self.ctx.identity.node,
            state=status.state,
            restarts=status.restarts,
            reason=reason,
            log=str(log_path(self.ctx.job, ROUTER_NAME, plan=self.ctx.plan)),
            metrics_url=head_record.metrics_url if head_record else None,
            status_url=head_record.status_url if head_record else None,
        )

    async def stop(self) -> None:
        """Stop the router within its grace (nothing to do before it starts)."""
        if self.supervisor is not None:
            await self.supervisor.stop()
