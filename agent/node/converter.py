"""TileRT's weight converter, as a decode agent runs it: its preflight, its run, its marker.

The converter runs through the agent's own launcher, as the engine would (under pyxis in the
decode's image, with the job's mounts), within ``agent.convert_budget_s``; its output goes to
``J/logs/<agent>/convert.log``. The weights gate (agent.node.conversion) decides when to run it,
under the folder's lock, and what to do with its result (docs/weights.md).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import trio

from agent.facts import WEIGHTS_INDEX_FILE
from agent.job.logfiles import convert_log_path
from agent.job.paths import JobDir
from agent.job.plan import ConvertPlan, Plan
from agent.launch import Launcher, ProcessHandle, preflight
from agent.launch.commands import STANDIN_MODULES, convert_command
from agent.launch.jobspecs import SpecBuilder
from agent.node.identity import Identity
from agent.node.logpump import LogSink
from agent.node.weightsfolder import ConvertedMarker, Inspection, WeightsError
from agent.problems import printable

# The last lines of convert.log a failure quotes.
CONVERT_LOG_TAIL = 5


class Converter:
    """The weight converter of one decode agent: checked once, then run into a folder."""

    def __init__(
        self,
        *,
        plan: Plan,
        job: JobDir,
        identity: Identity,
        launcher: Launcher,
        launch_spec: SpecBuilder,
        log: logging.Logger,
        budget_s: float,
    ) -> None:
        self.plan = plan
        self.job = job
        self.id = identity
        self.launcher = launcher
        self.launch_spec = launch_spec
        self.log = log
        self.budget_s = budget_s
        self.log_path = convert_log_path(job, identity.name)
        # What the converter's preflight found: the setup script to source, the tilert version.
        self.setup_script: Path | None = None
        self.versions: dict[str, str] = {}

    def module(self, convert: ConvertPlan) -> str:
        """The converter's module (the stand-in's under ``--mock decode``)."""
        return STANDIN_MODULES["converter"] if self.plan.standin("decode") else convert.program[-1]

    async def check(self, convert: ConvertPlan) -> None:
        """Can this node run the converter on the checkpoint? Seconds, before taking the lock."""
        checks = preflight.PreflightChecks(
            python=sys.executable if self.plan.standin("decode") else convert.program[0],
            modules=[self.module(convert)],
            distributions=["tilert"],
            # The stand-in needs no setup; the script belongs to the real image.
            setup_script=None if self.plan.standin("decode") else self.plan.setup_script,
            configs_dir=self.plan.configs_dir,
            paths=[convert.source],
        )
        base = self.launch_spec(
            f"{self.id.name}-convert-preflight", [], dict(os.environ), self.plan.decode.image
        )
        result = await preflight.run_preflight(self.launcher, base, checks)
        if not result.ok:
            raise WeightsError(
                f"the converter's preflight failed on {self.id.node} (the converter's "
                "environment): " + "; ".join(result.problems)
            )
        self.setup_script = Path(result.setup_script) if result.setup_script else None
        self.versions = dict(result.versions)

    async def run(
        self,
        convert: ConvertPlan,
        *,
        save_dir: str,
        temp: Path,
        append: bool,
        started: Callable[[int | None], None],
    ) -> int:
        """Run the converter into ``temp`` (``save_dir`` as it sees it) within the budget; its
        exit status. ``started`` gets its pid once it runs."""
        # ``convert``, not the plan's: the gate may have found its source (a hub id's snapshot).
        plan = msgspec.structs.replace(self.plan, convert=convert)
        cmd = convert_command(plan, name=self.id.name, save_dir=save_dir, append_mtp=append)
        spec = self.launch_spec(
            f"{self.id.name}-convert", cmd.argv, cmd.env, self.plan.decode.image
        )
        spec = replace(spec, setup_script=self.setup_script)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sink = LogSink(
            self.log_path,
            max_bytes=self.plan.agent.log_max_bytes,
            backups=self.plan.agent.log_backups,
        )
        try:
            try:
                process = await self.launcher.start(spec)
            except OSError as exc:
                raise WeightsError(f"could not start the converter {spec.argv[0]}: {exc}") from None
            sink.note(f"=== converter pid {process.pid}: {' '.join(spec.argv)} ===")
            self.log.info(
                "%s: converting %s into %s (pid %s, log %s, budget %gs)",
                self.id.name,
                convert.source,
                temp,
                process.pid,
                self.log_path,
                self.budget_s,
            )
            started(process.pid)
            return await self._wait(process, sink)
        finally:
            sink.close()

    async def _wait(self, process: ProcessHandle, sink: LogSink) -> int:
        try:
            with trio.move_on_after(self.budget_s) as budget:
                code = await sink.pump_until_exit(process)
            if budget.cancelled_caught:
                raise WeightsError(
                    f"the conversion did not finish within agent.convert_budget_s "
                    f"({self.budget_s:g}s) and was stopped; nothing was put in place. See "
                    f"{self.log_path}"
                )
            sink.note(f"=== converter pid {process.pid} ended with status {code} ===")
            return code
        finally:
            with trio.CancelScope(shield=True):
                await process.stop(self.plan.decode.stop_grace_s)

    def marker(self, convert: ConvertPlan, result: Inspection, append: bool) -> ConvertedMarker:
        """The completion marker of a conversion this agent ran, that produced ``result``."""
        now = time.time()
        return ConvertedMarker(
            converter=self.module(convert),
            converter_version=self.versions.get("tilert", "unknown"),
            source=convert.source,
            model_type=convert.model_type,
            append_mtp=append,
            converted_at=now,
            converted_at_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            index_file=WEIGHTS_INDEX_FILE,
            index_sha256=result.index_sha256 or "",
            shards=result.shard_count,
            total_bytes=result.total_bytes,
            agent=self.id.name,
            node=self.id.node,
            job=str(self.job.root),
        )

    def log_tail(self) -> str:
        """The last lines of convert.log, on one line (``(none)`` without any)."""
        # The file may lag (its writer runs in a thread); the sink's ring is gone: read the file.
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(none)"
        lines = [ln for ln in lines if ln.strip() and not ln.startswith("===")]
        return printable(" | ".join(lines[-CONVERT_LOG_TAIL:])) or "(none)"  # its words, escaped
