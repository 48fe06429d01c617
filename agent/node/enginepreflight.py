"""This node's checks before its engine's long load, seconds long, each failure final and
explained (docs/preflight.md): the node (stale processes, others' GPU processes, /dev/shm, disk),
the engine's environment as it will run (its interpreter, modules, pins, the connector), and the
flags it is given, asked of the engine itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from agent.launch import Launcher, preflight
from agent.launch.commands import Command, arg_value
from agent.launch.enginechecks import (
    connector_choice,
    engine_checks,
    flag_question,
    pin_problems,
    pinned,
)
from agent.launch.engineflags import flag_refusals
from agent.launch.jobspecs import JobSpecs
from agent.launch.scratch import socket_path_problem
from agent.node.hygiene import NodeScene, check_node
from agent.node.ownrecord import OwnRecord


class EnginePreflight:
    """One agent's preflight: ``run`` once before the engine; ``failure`` says why it failed."""

    def __init__(
        self,
        record: OwnRecord,
        launcher: Launcher,
        specs: JobSpecs,
        scratch_root: Path,
        started: float,
        on_change: Callable[[], None],
    ) -> None:
        # The record's job, plan and identity: this agent's; its versions are set here.
        self.job, self.plan, self.id, self.log = record.job, record.plan, record.id, record.log
        self.role = self.plan.role(self.id.role)
        self.launcher = launcher
        self.specs = specs
        self.record = record
        self.scratch_root = scratch_root
        self.started = started  # the agent's start: older processes of ours are stale
        self.on_change = on_change
        self.failure: str | None = None  # final: the agent serves it as its engine's state
        # The TileRT connector's stand-in goes on vLLM's PYTHONPATH (agent.launch.enginechecks).
        self.connector_standin = False

    def _fail(self, check: str, problems: list[str]) -> bool:
        """Record a final preflight failure naming the node, the check and each fix."""
        self.failure = f"preflight failed on {self.id.node} ({check}): " + "; ".join(problems)
        self.log.error("%s: %s", self.id.name, self.failure)
        self.on_change()
        return False

    async def _node_clean(self) -> bool:
        """The node checks (docs/preflight.md): each finding logged, failures refuse the load."""
        report = await check_node(self._scene(), self.plan.agent.preflight, self.log, self.id.name)
        if report.failures:
            checks = ", ".join(sorted({f.check for f in report.failures}))
            lines = [f.line() for f in report.failures]
            return self._fail(f"node checks {checks}", lines)
        return True

    def _scene(self) -> NodeScene:
        folders = {"scratch (agent.scratch_dir)": str(self.scratch_root)}
        weights = arg_value(self.role.args, "--model-weights-dir")
        if weights:
            folders["weights (roles.decode.args.model-weights-dir)"] = weights
        visible = os.environ.get(self.plan.visible_devices_env)
        return NodeScene(
            job_root=self.job.root,
            node=self.id.node,
            agent_pid=os.getpid(),
            started=self.started,
            env=os.environ,
            folders=folders,
            visible_gpus=frozenset(visible.split(",")) if visible else None,
            uses_gpus=self.role.gpus_per_worker > 0,
        )

    async def run(self, command: Command) -> bool:
        """The seconds-long checks before the long load; a failure is final and explained."""
        if not await self._node_clean():
            return False
        # The engine's own environment (role env, PATH, PYTHONPATH), as it will run.
        env = command.env
        checks = engine_checks(self.plan, self.id.role, env)
        base = self.specs(f"{self.id.name}-preflight", [], env, self.role.image)
        t0 = time.monotonic()
        result = await preflight.run_preflight(self.launcher, base, checks)
        connector = connector_choice(self.plan, env, result)
        problems = [*result.problems, *([connector.problem] if connector.problem else [])]
        if self.id.role == "prefill" and not self.plan.standin("prefill"):
            problems += [p for p in [socket_path_problem(env)] if p]
        if not self.plan.standin(self.id.role):
            problems += pin_problems(
                pinned(self.plan), result.versions, image=self.role.image, engine=self.id.role
            )
        if problems:
            return self._fail("the engine's environment", problems)
        self.record.versions = dict(result.versions)
        self.specs.setup_script = Path(result.setup_script) if result.setup_script else None
        role = self.role.role
        question = flag_question(self.plan, role, command.argv, standin=self.plan.standin(role))
        refused = await flag_refusals(
            self.launcher,
            self.specs(f"{self.id.name}-preflight", [], env, self.role.image),
            question,
            versions=self.record.versions,
            policy=self.plan.agent.preflight,
            log=self.log,
            who=self.id.name,
        )
        if refused:
            return self._fail("engine flags (agent.preflight.engine_flags)", refused)
        self.connector_standin = connector.use_standin
        if connector.note:
            self.log.warning("%s: %s", self.id.name, connector.note)
        self.log.info(
            "%s: preflight ok in %.2fs (versions %s, setup script %s)",
            self.id.name,
            time.monotonic() - t0,
            self.record.versions or "none",
            self.specs.setup_script,
        )
        return True
