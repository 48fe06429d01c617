"""The gate before a decode engine: its weights folder is complete, converted exactly once.

``WeightsGate.ready`` runs on the decode node after the preflight and before the engine starts:

1. a complete folder (agent.node.weightsfolder) is served as it is, never converted again;
2. an incomplete one with a conversion in progress (a live lock, agent.node.folderlock) is waited
   for, showing ``converting`` with the holder's node, bytes written and rate;
3. an incomplete one without ``roles.decode.convert`` fails at once, saying what is missing and
   how to convert it;
4. otherwise this agent takes the lock and converts: TileRT's converter (agent.node.converter),
   through the agent's own launcher (as the engine would run), writes into a hidden sibling
   folder, its output going to ``J/logs/<agent>/convert.log``; on success the agent checks the
   result, writes the marker and renames the folder into place; on failure it removes its folder
   and releases the lock, and the error names the log. A stale lock (its holder died) is taken
   over and the holder's leftovers deleted.

The agent works on the folder as its node sees it; under pyxis the converter and the engine see it
through the job's container mounts, so the path is mapped back through them
(agent.node.weightsfolder.weights_paths). The folder and the model profile are the plan's
(``plan.decode.weights_dir``, ``plan.decode.model_profile``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec
import trio

from agent.facts import CONVERTER_MODEL_TYPES, human_bytes
from agent.job.logfiles import convert_log_path
from agent.job.paths import JobDir
from agent.job.plan import (
    DEFAULT_CONVERT_BUDGET_S,
    DEFAULT_CONVERT_LOCK_STALE_S,
    ConvertPlan,
    Plan,
)
from agent.job.records import ConvertProgress, EngineStatus
from agent.job.vocab import EngineState
from agent.launch import Launcher
from agent.launch.jobspecs import SpecBuilder
from agent.node.converter import Converter
from agent.node.converting import Conversion
from agent.node.folderlock import (
    LockInfo,
    Observed,
    StaleWatch,
    failed_verdict,
    new_token,
    observe,
    take_over,
    try_acquire,
)
from agent.node.hubcache import HubCacheError, snapshot
from agent.node.identity import Identity
from agent.node.weightsfolder import (
    MARKER_NAME,
    Inspection,
    Siblings,
    WeightsError,
    WeightsPaths,
    inspect,
    weights_paths,
)

# Heartbeats and polls: often enough for the staleness rule, rarely enough for a shared FS.
MAX_HEARTBEAT_S = 10.0
MAX_POLL_S = 1.0
HOW_TO_CONVERT = (
    "add roles.decode.convert (source: the Hugging Face checkpoint) to the recipe and the agent "
    "converts it before the engine starts, or run `tilert-submit convert RECIPE` ahead of the job "
    "(docs/weights.md)"
)


class WeightsGate:
    """Checks, waits for or converts a decode agent's weights folder before its engine starts."""

    def __init__(
        self,
        *,
        plan: Plan,
        job: JobDir,
        identity: Identity,
        launcher: Launcher,
        launch_spec: SpecBuilder,
        log: logging.Logger,
        on_change: Callable[[], None],
    ) -> None:
        self.plan = plan
        self.job = job
        self.id = identity
        self.launcher = launcher
        self.launch_spec = launch_spec
        self.log = log
        self.on_change = on_change
        self.folder = plan.decode.weights_dir
        self.convert: ConvertPlan | None = (
            None if isinstance(plan.convert, msgspec.UnsetType) else plan.convert
        )
        self.budget_s = self.convert.budget_s if self.convert else DEFAULT_CONVERT_BUDGET_S
        self.stale_s = self.convert.lock_stale_s if self.convert else DEFAULT_CONVERT_LOCK_STALE_S
        self.heartbeat_s = max(0.05, min(MAX_HEARTBEAT_S, self.stale_s / 4))
        self.poll_s = max(0.05, min(MAX_POLL_S, self.stale_s / 4))
        self.converter = Converter(
            plan=plan,
            job=job,
            identity=identity,
            launcher=launcher,
            launch_spec=launch_spec,
            log=log,
            budget_s=self.budget_s,
        )
        self.log_path = self.converter.log_path
        # What /status shows while the gate is working (None: nothing to show).
        self.state: EngineState | None = None
        self.reason = ""
        self.since = time.time()
        self.pid: int | None = None
        self.failure: str | None = None
        self.done: Inspection | None = None
        self.shown_progress: ConvertProgress | None = None
        self._converter_checked = False
        # The conversion this agent runs under the lock (agent.node.converting).
        self.conversion = Conversion(
            self, self.converter, poll_s=self.poll_s, heartbeat_s=self.heartbeat_s
        )

    # ---- what /status shows ------------------------------------------------------------------

    def status(self) -> EngineStatus | None:
        """The agent's state while converting or waiting, or after a failure; else None."""
        if self.state is None:
            return None
        return EngineStatus(
            state=self.state,
            pid=self.pid,
            ports={},
            restarts=0,
            reason=self.reason,
            since=self.since,
            uptime_s=None,
        )

    def progress(self) -> ConvertProgress | None:
        """The conversion this agent runs or waits for, while it does."""
        return self.shown_progress if self.state == "converting" else None

    def show(self, state: EngineState | None, reason: str) -> None:
        """What /status shows now (None: nothing, the engine's own state)."""
        if (state, reason) == (self.state, self.reason):
            return
        if state != self.state:
            self.since = time.time()
        self.state, self.reason = state, reason
        self.on_change()

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self.pid = None
        self.log.error("%s: weights: %s", self.id.name, reason)
        self.show("failed", f"weights: {reason}")

    # ---- the gate ----------------------------------------------------------------------------

    async def ready(self) -> bool:
        """True when the engine may start; False when it must not (the reason is in ``status``)."""
        if not self.folder:
            return True
        if self.convert is None and self.expected_model_type() is None:
            # glm5_2's own converter writes another layout (rank folders, tilert_meta.json), which
            # the decode server checks itself; there is no marker to look for.
            self.log.info(
                "%s: weights %s are not checked: the %s profile's converter is not TileRT's "
                "weight_converter",
                self.id.name,
                self.folder,
                self.plan.decode.model_profile,
            )
            return True
        try:
            paths = weights_paths(self.folder, self.plan.mounts, self.plan.launcher)
            if self.convert is not None and not self.convert.source.startswith("/"):
                self.convert = await self._from_hub_cache(self.convert)
            await self._until_complete(paths)
        except WeightsError as exc:
            self._fail(str(exc))
            return False
        except OSError as exc:
            self._fail(f"file system error on {self.folder}'s folder: {exc}")
            return False
        self.pid = None
        self.show(None, "")
        return True

    async def _from_hub_cache(self, convert: ConvertPlan) -> ConvertPlan:
        """A hub-id source: its snapshot in the decode's Hugging Face cache (docs/weights.md)."""
        env = {**os.environ, **self.plan.decode.env}
        find = partial(snapshot, convert.source, env, self.plan.mounts, self.plan.launcher)
        try:
            folder = await trio.to_thread.run_sync(find)
        except HubCacheError as exc:
            raise WeightsError(str(exc)) from None
        self.log.info("%s: converting %s from %s", self.id.name, convert.source, folder)
        return msgspec.structs.replace(convert, source=folder)

    def expected_model_type(self) -> str | None:
        """The model type the decode needs (the recipe's, else the profile's; None: unchecked)."""
        if self.convert is not None:
            return self.convert.model_type
        return CONVERTER_MODEL_TYPES.get(self.plan.decode.model_profile)

    def accept(self, found: Inspection) -> None:
        """A complete folder: check it is the model the decode serves, then say so."""
        marker = found.marker
        if marker is None:  # inspect() never calls a folder without a marker complete
            raise WeightsError(f"{found.folder} has no {MARKER_NAME}")
        want = self.expected_model_type()
        if want is not None and marker.model_type != want:
            raise WeightsError(
                f"{found.folder} holds a {marker.model_type} conversion (of {marker.source}), but "
                f"the decode needs {want}; point roles.decode.args.model-weights-dir at another "
                "folder (the agent never converts a complete folder again)"
            )
        if self.convert is not None and marker.source != self.convert.source:
            self.log.warning(
                "%s: %s was converted from %s, the recipe names %s; serving it as it is",
                self.id.name,
                found.folder,
                marker.source,
                self.convert.source,
            )
        self.done = found
        self.log.info(
            "%s: weights %s complete: %d shards, %s, converted by %s on %s at %s",
            self.id.name,
            found.folder,
            found.shard_count,
            human_bytes(found.total_bytes),
            marker.agent,
            marker.node,
            marker.converted_at_utc,
        )

    async def _until_complete(self, paths: WeightsPaths) -> None:
        """Return once the folder is complete (found, waited for, or converted here)."""
        siblings = Siblings(paths.host)
        marker = paths.host / MARKER_NAME
        found: Inspection | None = None
        watch = StaleWatch(self.stale_s)
        # The holder's lock this agent has been waiting on, and when it vanished.
        waited_on: Observed | None = None
        vanished: float | None = None
        waiting_since = trio.current_time()
        while True:
            # Without a marker nothing changed that matters: no need to read every shard again.
            if found is None or await trio.to_thread.run_sync(marker.exists):
                found = await trio.to_thread.run_sync(inspect, paths.host)
            if found.complete:
                self.accept(found)
                return
            seen = await trio.to_thread.run_sync(observe, siblings.lock)
            if seen is None and waited_on is not None:
                # The holder let go and the folder is still incomplete: its conversion failed or
                # was stopped. Unless someone is just taking a stale lock over: a moment for them.
                vanished = vanished or trio.current_time()
                if trio.current_time() - vanished < self.stale_s / 2:
                    await trio.sleep(self.poll_s)
                    continue
                raise WeightsError(self._holder_failed(paths, waited_on, found))
            if seen is None:
                if await self._convert_here(paths, siblings, found):
                    return
                continue  # someone else created the lock first: wait for them
            self._fail_on_verdict(paths, seen, waited_on, found)
            if waited_on is None:
                self.log.info(
                    "%s: %s is incomplete and being converted by %s (lock %s): waiting",
                    self.id.name,
                    paths.host,
                    self._holder(seen),
                    siblings.lock,
                )
            waited_on, vanished = seen, None
            self._waiting(paths, seen)
            if watch.stale(seen, trio.current_time()):
                if self.convert is not None:
                    await self._check_converter(self.convert)  # before: take over, then lock
                await self._stale(paths, siblings, seen, found)
                watch, waited_on = StaleWatch(self.stale_s), None
                continue
            if trio.current_time() - waiting_since > self.budget_s + self.stale_s:
                raise WeightsError(
                    f"waited {self.budget_s + self.stale_s:g}s (agent.convert_budget_s + "
                    f"agent.convert_lock_stale_s) for {self._holder(seen)} to convert "
                    f"{paths.host}; see {self._holder_log(seen)}"
                )
            await trio.sleep(self.poll_s)

    @staticmethod
    def _holder_log(seen: Observed) -> str:
        info = seen.info
        if info is None:
            return "the converting agent's convert.log"
        return str(convert_log_path(JobDir(Path(info.job)), info.agent))

    def _fail_on_verdict(
        self, paths: WeightsPaths, seen: Observed, waited_on: Observed | None, found: Inspection
    ) -> None:
        """Fail with the verdict the holder left in its lock, if it failed (docs/weights.md)."""
        verdict = failed_verdict(seen, waited_on, str(self.job.root))
        if verdict is not None:
            raise WeightsError(self._holder_failed(paths, seen, found, verdict))

    def _holder_failed(
        self, paths: WeightsPaths, seen: Observed, found: Inspection, why: str = ""
    ) -> str:
        said = f": {why}" if why else f" ({found.summary()})"
        return (
            f"the conversion of {paths.host} by {self._holder(seen)} ended without completing "
            f"it{said}; see {self._holder_log(seen)}. Nothing was put in place: the next job "
            "converts it from scratch"
        )

    @staticmethod
    def _holder(seen: Observed) -> str:
        info = seen.info
        if info is None:
            return "another agent"
        return f"{info.agent} on {info.node} (job {info.job})"

    def _waiting(self, paths: WeightsPaths, seen: Observed) -> None:
        info = seen.info
        if info is not None:
            self.shown_progress = ConvertProgress(
                folder=str(paths.host),
                role="waiting",
                holder=info.agent,
                holder_node=info.node,
                holder_job=info.job,
                bytes_written=info.bytes_written,
                rate_bytes_s=info.rate_bytes_s,
                started_at=info.started_at,
            )
        written = (
            f": {human_bytes(info.bytes_written)} written, {human_bytes(info.rate_bytes_s)}/s"
            if info is not None
            else ""
        )
        self.show(
            "converting", f"waiting for {self._holder(seen)} to convert {paths.host}{written}"
        )

    async def _stale(
        self, paths: WeightsPaths, siblings: Siblings, seen: Observed, found: Inspection
    ) -> None:
        holder = self._holder(seen)
        if self.convert is None:
            raise WeightsError(
                f"{paths.host} is not a complete TileRT conversion ({found.summary()}), and the "
                f"conversion by {holder} stopped: its lock {siblings.lock} was not refreshed for "
                f"{self.stale_s:g}s (agent.convert_lock_stale_s). To convert it: {HOW_TO_CONVERT}"
            )
        self.log.warning(
            "%s: the conversion lock %s of %s was not refreshed for %gs "
            "(agent.convert_lock_stale_s): taking it over",
            self.id.name,
            siblings.lock,
            holder,
            self.stale_s,
        )
        await trio.to_thread.run_sync(take_over, siblings.lock, seen)

    def _lock_info(self, token: str, siblings: Siblings) -> LockInfo:
        return LockInfo(
            token=token,
            agent=self.id.name,
            node=self.id.node,
            job=str(self.job.root),
            pid=os.getpid(),
            temp=siblings.converting(token).name,
            started_at=time.time(),
        )

    # ---- converting --------------------------------------------------------------------------

    async def _check_converter(self, convert: ConvertPlan) -> None:
        """Once per gate: can this node run the converter? Seconds, before taking the lock."""
        if self._converter_checked:
            return
        self.show("converting", "checking the converter (preflight)")
        await self.converter.check(convert)
        self._converter_checked = True

    async def _convert_here(
        self, paths: WeightsPaths, siblings: Siblings, found: Inspection
    ) -> bool:
        """Nobody holds the lock: take it and convert; False when another agent took it first."""
        convert = self.convert
        if convert is None:
            raise WeightsError(
                f"{paths.host} is not a complete TileRT conversion: {found.summary()}. "
                f"To convert it: {HOW_TO_CONVERT}"
            )
        await self._check_converter(convert)
        token = new_token()
        # The lock lives beside the folder: its parent may not exist yet.
        await trio.to_thread.run_sync(partial(paths.host.parent.mkdir, parents=True, exist_ok=True))
        held = await trio.to_thread.run_sync(
            try_acquire, siblings.lock, self._lock_info(token, siblings)
        )
        if held is None:
            return False
        await self.conversion.run(convert, held, paths, siblings, token)
        return True
