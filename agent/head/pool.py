"""The decode pool while the job serves: who joins, who leaves, and since when.

``tilert-submit scale`` writes ``J/pool.json`` (``agent.job.pool``); the head looks at the file's
stat every ``POOL_LOOK_S`` (cheap; a change wakes it) and reads it only when it changed. A decode
the file adds is ``joining``: followed like any agent, proven once healthy by canaries through a
trial router (``agent.head.trial``), and only then put in the serving router's list (a router
hand-over) as a ``member``. A decode the file removes is ``leaving``: out of the router's list
first, then asked to leave (``POST /leave``: its agent waits until its engine is idle, bounded,
then stops); once its agent has exited it is no longer shown.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import trio

from agent.job.paths import JobDir
from agent.job.pool import DecodePool, PoolFileError, read_pool
from agent.problems import printable

POOL_LOOK_S = 0.5
# A joining decode whose trial failed is tried again after this.
TRIAL_RETRY_S = 5.0


@dataclass
class PoolFile:
    """``J/pool.json`` as the head last read it; read again only when its stat changed."""

    job: JobDir
    workers: int
    log: logging.Logger
    pool: DecodePool | None = None
    _key: tuple[int, int, int] | None = None
    _problem: str | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.job.pool)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> bool:
        """Whether the file changed since it was last read."""
        return self._stat() != self._key

    def read(self) -> DecodePool | None:
        """The pool asked for (None while there is no file); a bad file is said once and the
        last good pool kept."""
        key = self._stat()
        if key == self._key:
            return self.pool
        self._key = key
        if key is None:
            return self.pool
        try:
            self.pool = read_pool(self.job, self.workers)
            self._problem = None
        except (OSError, PoolFileError) as exc:
            problem = printable(str(exc))
            if problem != self._problem:
                self._problem = problem
                self.log.warning(
                    "head: %s cannot be used (%s); keeping the pool as it is",
                    self.job.pool,
                    problem,
                )
        return self.pool

    async def watch(self, poke: Callable[[], None]) -> None:
        """Wake the head whenever the file changes (runs forever)."""
        while True:
            if self.changed():
                poke()
            await trio.sleep(POOL_LOOK_S)


@dataclass
class Membership:
    """Where each decode stands in the pool: joining, leaving, and since when each is a member."""

    # name -> since when (Unix seconds)
    joining: dict[str, float] = field(default_factory=dict)
    leaving: dict[str, float] = field(default_factory=dict)
    member_since: dict[str, float] = field(default_factory=dict)
    # Why a joining decode is still out (its trial failed), shown as its reason.
    note: dict[str, str] = field(default_factory=dict)
    trying: bool = False  # a trial router runs
    retry_at: float = 0.0  # trio clock; no trial before

    def changes(
        self, wanted: Collection[str], members: Collection[str]
    ) -> tuple[list[str], list[str]]:
        """The decodes to add (joining) and to take out (members or joining) for ``wanted``."""
        current = set(members) | set(self.joining)
        join = sorted(n for n in wanted if n not in current and n not in self.leaving)
        leave = sorted(n for n in current if n not in wanted)
        return join, leave
