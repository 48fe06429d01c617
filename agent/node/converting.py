"""This agent converting a decode's weights folder under the lock (step 4 of
``agent.node.conversion``): TileRT's converter into a hidden sibling folder, the lock refreshed
and the progress measured meanwhile, the result checked, marked and renamed into place; on failure
its folder removed and its verdict left in the lock for the agents waiting on it.
"""

from __future__ import annotations

import logging
from collections import deque
from functools import partial
from pathlib import Path
from typing import Protocol

import trio

from agent.facts import human_bytes
from agent.job.paths import JobDir
from agent.job.plan import ConvertPlan
from agent.job.records import ConvertProgress
from agent.job.vocab import EngineState
from agent.node.converter import Converter
from agent.node.folderlock import HeldLock, LockLost
from agent.node.identity import Identity
from agent.node.weightsfolder import (
    Inspection,
    Siblings,
    WeightsError,
    WeightsPaths,
    copy_for_append,
    folder_bytes,
    inspect,
    remove_tree,
    replace_folder,
    write_marker,
)

# The rate shown is over this window (a converter writes in bursts, one shard at a time).
RATE_WINDOW_S = 30.0
# A failed holder keeps its verdict in the lock this many of its waiters' polls (docs/weights.md).
VERDICT_POLLS = 3


class Gate(Protocol):
    """What the conversion reads and shows of its gate (``conversion.WeightsGate``)."""

    job: JobDir
    id: Identity
    log: logging.Logger
    pid: int | None  # the converter's, while it runs
    shown_progress: ConvertProgress | None

    def show(self, state: EngineState | None, reason: str) -> None:
        """What /status shows now."""

    def accept(self, found: Inspection) -> None:
        """A complete folder: check it is the model the decode serves, then say so."""

    def expected_model_type(self) -> str | None:
        """The model type the decode needs (None: not checked)."""


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


class Conversion:
    """One gate's conversions under the lock (one at a time)."""

    def __init__(
        self, gate: Gate, converter: Converter, *, poll_s: float, heartbeat_s: float
    ) -> None:
        self.gate = gate
        self.converter = converter
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        # Bytes already in the conversion folder before the converter ran (an --append_mtp copy).
        self._baseline = 0

    async def run(
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
            self.gate.log.warning(
                "%s: cannot leave the verdict in the lock: %s", self.gate.id.name, exc
            )
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
            written = max(0, written - self._baseline) if self.gate.pid else 0
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
                    self.gate.log.warning(
                        "%s: cannot refresh the conversion lock: %s", self.gate.id.name, exc
                    )
            self.gate.shown_progress = ConvertProgress(
                folder=str(paths.host),
                role="converting",
                holder=self.gate.id.name,
                holder_node=self.gate.id.node,
                holder_job=str(self.gate.job.root),
                bytes_written=written,
                rate_bytes_s=per_s,
                started_at=held.info.started_at,
            )
            if self.gate.pid:
                self.gate.show(
                    "converting",
                    f"converting {paths.host}: {human_bytes(written)} written, "
                    f"{human_bytes(per_s)}/s (log {self.converter.log_path})",
                )
            await trio.sleep(min(self.poll_s, self.heartbeat_s))

    async def _convert(
        self, convert: ConvertPlan, paths: WeightsPaths, siblings: Siblings, temp: Path, token: str
    ) -> None:
        found = await trio.to_thread.run_sync(inspect, paths.host)
        if found.complete:
            self.gate.accept(found)  # finished by the holder we waited for, just before we locked
            return
        refuse_unsafe(paths, found)
        for leftover in await trio.to_thread.run_sync(siblings.leftovers, token):
            if await self._adopt_finished(leftover, paths, siblings, token, found):
                return
            self.gate.log.info(
                "%s: removing %s (left by a conversion that died)", self.gate.id.name, leftover
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
                started=partial(self._started, paths),
            )
        finally:
            self.gate.pid = None
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WeightsError(
                f"the converter {how} converting {paths.host}; nothing was put in place. See "
                f"{self.converter.log_path}; last lines: {self.converter.log_tail()}"
            )
        result = await trio.to_thread.run_sync(partial(inspect, temp, marker_required=False))
        if result.problems:
            raise WeightsError(
                f"the converter exited 0 but its output is incomplete ({result.summary()}); "
                f"nothing was put in place. See {self.converter.log_path}"
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
        self.gate.log.info(
            "%s: converted %s: %d shards, %s",
            self.gate.id.name,
            paths.host,
            final.shard_count,
            human_bytes(final.total_bytes),
        )
        self.gate.accept(final)

    def _started(self, paths: WeightsPaths, pid: int | None) -> None:
        self.gate.pid = pid
        self.gate.show(
            "converting", f"converting {paths.host}: starting (log {self.converter.log_path})"
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
        if found.marker.model_type != self.gate.expected_model_type():
            return False
        self.gate.log.info(
            "%s: %s holds a finished conversion: renaming it into place",
            self.gate.id.name,
            leftover,
        )
        await trio.to_thread.run_sync(
            replace_folder, leftover, paths.host, siblings.replaced(token)
        )
        final = await trio.to_thread.run_sync(inspect, paths.host)
        if not final.complete:
            return False
        self.gate.accept(final)
        return True


def refuse_unsafe(paths: WeightsPaths, found: Inspection) -> None:
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
