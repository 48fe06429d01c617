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
from collections import deque
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
from agent.node.folderlock import (
    HeldLock,
    LockInfo,
    LockLost,
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
    copy_for_append,
    folder_bytes,
    inspect,
    remove_tree,
    replace_folder,
    weights_paths,
    write_marker,
)

# The rate shown is over this window (a converter writes in bursts, one shard at a time).
RATE_WINDOW_S = 30.0
# Heartbeats and polls: often enough for the staleness rule, rarely enough for a shared FS.
MAX_HEARTBEAT_S = 10.0
MAX_POLL_S = 1.0
# A failed holder keeps its verdict in the lock this many of its waiters' polls (docs/weights.md).
VERDICT_POLLS = 3
HOW_TO_CONVERT = (
    "add roles.decode.convert (source: the Hugging Face checkpoint) to the recipe and the agent "
    "converts it before the engine starts, or run `tilert-submit convert RECIPE` ahead of the job "
    "(docs/weights.md)"
)


class _Rate:
    """Bytes per second over the last ``RATE_WINDOW_S``."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, written: int) -> float:
        self._samples.append((now, written))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


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
        self._progress: ConvertProgress | None = None
        self._converter_checked = False
        # Bytes already in the conversion folder before the converter ran (an --append_mtp copy).
        self._baseline = 0

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
        return self._progress if self.state == "converting" else None

    def _show(self, state: EngineState | None, reason: str) -> None:
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
        self._show("failed", f"weights: {reason}")

    # ---- the gate ----------------------------------------------------------------------------

    async def ready(self) -> bool:
        """True when the engine may start; False when it must not (the reason is in ``status``)."""
        if not self.folder:
            return True
        if self.convert is None and self._expected_model_type() is None:
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
        self._show(None, "")
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

    def _expected_model_type(self) -> str | None:
        if self.convert is not None:
            return self.convert.model_type
        return CONVERTER_MODEL_TYPES.get(self.plan.decode.model_profile)

    def _accept(self, found: Inspection) -> None:
        """A complete folder: check it is the model the decode serves, then say so."""
        marker = found.marker
        if marker is None:  # inspect() never calls a folder without a marker complete
            raise WeightsError(f"{found.folder} has no {MARKER_NAME}")
        want = self._expected_model_type()
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
                self._accept(found)
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
            self._progress = ConvertProgress(
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
        self._show(
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
        self._show("converting", "checking the converter (preflight)")
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
        await self._convert_holding(convert, held, paths, siblings, token)
        return True

    async def _convert_holding(
        self,
        convert: ConvertPlan,
        held: HeldLock,
        paths: WeightsPaths,
        siblings: Siblings,
        token: str,
    ) -> None:
        """Convert under the lock; the lock is released and our folder gone whatever happens."""
        temp = siblings.converting(token)
        lost: list[str] = []
        failed: WeightsError | OSError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeat, held, paths, temp, lost, nursery.cancel_scope)
                try:
                    await self._convert(convert, paths, siblings, temp, token)
                except (WeightsError, OSError) as exc:  # raised here, not as an ExceptionGroup
                    failed = exc
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(remove_tree, temp)
                if failed is not None:
                    await self._leave_verdict(held, str(failed))
                await trio.to_thread.run_sync(held.release)
        if lost:
            raise WeightsError(
                f"stopped converting {paths.host}: {lost[0]}; another agent took the conversion "
                "over (this agent did not refresh its lock for agent.convert_lock_stale_s)"
            )
        if failed is not None:
            raise failed

    async def _leave_verdict(self, held: HeldLock, reason: str) -> None:
        """Tell the waiters why, in the lock, for ``VERDICT_POLLS`` of their polls (seconds)."""
        try:
            await trio.to_thread.run_sync(held.fail, reason)
        except OSError as exc:  # they fall back to the vanished lock (docs/weights.md)
            self.log.warning("%s: cannot leave the verdict in the lock: %s", self.id.name, exc)
            return
        await trio.sleep(VERDICT_POLLS * self.poll_s)

    async def _heartbeat(
        self,
        held: HeldLock,
        paths: WeightsPaths,
        temp: Path,
        lost: list[str],
        scope: trio.CancelScope,
    ) -> None:
        """Refresh the lock every ``heartbeat_s``; measure the progress every ``poll_s``."""
        rate = _Rate()
        beaten = -float("inf")
        while True:
            written = await trio.to_thread.run_sync(folder_bytes, temp)
            written = max(0, written - self._baseline) if self.pid else 0
            now = trio.current_time()
            per_s = rate.add(now, written)
            if now - beaten >= self.heartbeat_s:
                beaten = now
                try:
                    await trio.to_thread.run_sync(
                        partial(held.beat, bytes_written=written, rate_bytes_s=per_s)
                    )
                except LockLost as exc:
                    lost.append(str(exc))
                    scope.cancel()
                    return
                except OSError as exc:  # a stalled or failing file system: staleness decides
                    self.log.warning(
                        "%s: cannot refresh the conversion lock: %s", self.id.name, exc
                    )
            self._progress = ConvertProgress(
                folder=str(paths.host),
                role="converting",
                holder=self.id.name,
                holder_node=self.id.node,
                holder_job=str(self.job.root),
                bytes_written=written,
                rate_bytes_s=per_s,
                started_at=held.info.started_at,
            )
            if self.pid:
                self._show(
                    "converting",
                    f"converting {paths.host}: {human_bytes(written)} written, "
                    f"{human_bytes(per_s)}/s (log {self.log_path})",
                )
            await trio.sleep(min(self.poll_s, self.heartbeat_s))

    async def _convert(
        self, convert: ConvertPlan, paths: WeightsPaths, siblings: Siblings, temp: Path, token: str
    ) -> None:
        found = await trio.to_thread.run_sync(inspect, paths.host)
        if found.complete:
            self._accept(found)  # finished by the holder we waited for, just before we locked
            return
        self._refuse_unsafe(paths, found)
        for leftover in await trio.to_thread.run_sync(siblings.leftovers, token):
            if await self._adopt_finished(leftover, paths, siblings, token, found):
                return
            self.log.info(
                "%s: removing %s (left by a conversion that died)", self.id.name, leftover
            )
            await trio.to_thread.run_sync(remove_tree, leftover)
        append = convert.append_mtp and found.shards_complete
        if append:
            await trio.to_thread.run_sync(copy_for_append, paths.host, temp)
        else:
            await trio.to_thread.run_sync(temp.mkdir)
        self._baseline = await trio.to_thread.run_sync(folder_bytes, temp)
        try:
            code = await self.converter.run(
                convert,
                save_dir=paths.engine_path(temp),
                temp=temp,
                append=append,
                started=partial(self._converter_started, paths),
            )
        finally:
            self.pid = None
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WeightsError(
                f"the converter {how} converting {paths.host}; nothing was put in place. See "
                f"{self.log_path}; last lines: {self.converter.log_tail()}"
            )
        result = await trio.to_thread.run_sync(partial(inspect, temp, marker_required=False))
        if result.problems:
            raise WeightsError(
                f"the converter exited 0 but its output is incomplete ({result.summary()}); "
                f"nothing was put in place. See {self.log_path}"
            )
        marker = self.converter.marker(convert, result, append)
        try:
            await trio.to_thread.run_sync(write_marker, temp, marker)
            await trio.to_thread.run_sync(
                replace_folder, temp, paths.host, siblings.replaced(token)
            )
        except OSError as exc:
            raise WeightsError(
                f"cannot put the conversion in place at {paths.host}: {exc}; nothing was put in "
                "place"
            ) from None
        final = await trio.to_thread.run_sync(inspect, paths.host)
        if not final.complete:
            raise WeightsError(
                f"{paths.host} is incomplete right after the conversion: {final.summary()}"
            )
        self.log.info(
            "%s: converted %s: %d shards, %s",
            self.id.name,
            paths.host,
            final.shard_count,
            human_bytes(final.total_bytes),
        )
        self._accept(final)

    def _converter_started(self, paths: WeightsPaths, pid: int | None) -> None:
        self.pid = pid
        self._show("converting", f"converting {paths.host}: starting (log {self.log_path})")

    def _refuse_unsafe(self, paths: WeightsPaths, found: Inspection) -> None:
        """Never replace what is not ours to delete, nor what the converter could not reach."""
        if found.foreign:
            shown = ", ".join(found.foreign[:3]) + (" ..." if len(found.foreign) > 3 else "")
            raise WeightsError(
                f"{paths.host} is incomplete ({found.summary()}) and holds entries that are not "
                f"TileRT weights ({shown}); the agent replaces an incomplete folder with the "
                "conversion and never deletes what it did not write: move them away, or convert "
                "into another folder"
            )
        if paths.host.is_symlink():
            raise WeightsError(
                f"{paths.host} is a symbolic link; the agent converts next to the folder and "
                "renames the result into place: point roles.decode.args.model-weights-dir at the "
                "real folder"
            )
        if not paths.siblings_visible:
            raise WeightsError(
                f"the weights folder {paths.engine} is itself a container mount, so the converter "
                "cannot write next to it: mount its parent folder instead"
            )

    async def _adopt_finished(
        self, leftover: Path, paths: WeightsPaths, siblings: Siblings, token: str, now: Inspection
    ) -> bool:
        """A dead holder's conversion that finished but was not renamed into place: use it."""
        if "-converting-" not in leftover.name or (now.exists and not now.empty):
            return False
        found = await trio.to_thread.run_sync(inspect, leftover)
        if not found.complete or found.marker is None:
            return False
        if found.marker.model_type != self._expected_model_type():
            return False
        self.log.info(
            "%s: %s holds a finished conversion: renaming it into place", self.id.name, leftover
        )
        await trio.to_thread.run_sync(
            replace_folder, leftover, paths.host, siblings.replaced(token)
        )
        final = await trio.to_thread.run_sync(inspect, paths.host)
        if not final.complete:
            return False
        self._accept(final)
        return True
