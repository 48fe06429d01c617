"""The lock around ``J/pool.json``'s read-modify-write: two ``tilert-submit scale`` at once never
lose an update (docs/cli.md, "Scaling the decode pool").

``J/pool.lock`` is the weights conversion's kind of lock (``agent.node.folderlock``): a file
created with ``O_EXCL``, which every shared file system honours, holding who took it
(``LockInfo``: pid, node, since). ``scale`` holds it from reading the pool to its last write (a
Slurm grow job's id is written in after ``sbatch``), seconds, never while it waits for the pool to
settle, so it needs no heartbeat. A ``scale`` that finds it held says who holds it and exits 1
(``PoolBusy``). A lock whose holder is gone, its pid on this node no longer the process that took
it (a ``scale`` killed by SIGKILL), is taken over; one taken on another node is never judged by
clocks: the message names the file to remove if no ``scale`` runs there.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import psutil

from agent.errors import RuntimeFailure
from agent.job.paths import JobDir
from agent.node.folderlock import HeldLock, LockInfo, Observed, new_token, observe, take_over
from agent.node.folderlock import try_acquire as try_create
from agent.problems import printable

HOLDER = "tilert-submit scale"
# A pid's start time and the lock's are taken a moment apart, by two clocks' readings.
START_SLACK_S = 2.0
TRIES = 3


class PoolBusy(RuntimeFailure):
    """Another ``scale`` holds ``J/pool.lock``; the message says who and what to do."""


def _gone(seen: Observed) -> bool:
    """Whether the holder of ``seen`` was a process of this node that no longer runs."""
    info = seen.info
    if info is None or info.node != socket.gethostname():
        return False
    try:
        return psutil.Process(info.pid).create_time() > info.started_at + START_SLACK_S
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def busy_message(job: JobDir, seen: Observed | None) -> str:
    """What a ``scale`` that finds the lock held says."""
    info = seen.info if seen is not None else None
    if info is None:
        who = "another tilert-submit scale is changing the pool of this job"
    else:
        since = datetime.fromtimestamp(info.started_at).strftime("%H:%M:%S")
        who = (
            f"another tilert-submit scale is changing the pool of this job (pid {info.pid} on "
            f"{printable(info.node)}, since {since})"
        )
    return (
        f"{who}: wait for it to end, then run scale again (it reads the pool it left); if no "
        f"scale runs, remove {job.pool_lock}"
    )


@contextmanager
def pool_lock(job: JobDir) -> Iterator[HeldLock]:
    """Hold ``J/pool.lock`` for the block; ``PoolBusy`` when another ``scale`` holds it."""
    info = LockInfo(
        token=new_token(),
        agent=HOLDER,
        node=socket.gethostname(),
        job=str(job.root),
        pid=os.getpid(),
        temp="",
        started_at=time.time(),
    )
    lock: HeldLock | None = None
    seen: Observed | None = None
    for _ in range(TRIES):
        lock = try_create(job.pool_lock, info)
        if lock is not None:
            break
        seen = observe(job.pool_lock)
        if seen is not None and not (_gone(seen) and take_over(job.pool_lock, seen)):
            break  # held by a live scale (or one this node cannot judge)
    if lock is None:
        raise PoolBusy(busy_message(job, seen))
    try:
        yield lock
    finally:
        lock.release()
