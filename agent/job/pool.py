"""``J/pool.json``: the decode pool a running job is asked to have (``tilert-submit scale``).

One writer, ``tilert-submit scale`` (atomically, under ``J/pool.lock``: submit.poollock); readers:
the head (which decodes are in the router's list), the ``--local`` supervisor (which agents to
start), every agent (an index beyond the plan's count is valid while the pool names it). Without the
file the pool is the plan's: decodes ``0 .. roles.decode.nodes - 1``. docs/cli.md ("Scaling the
decode pool") describes it.
"""

from __future__ import annotations

import contextlib
import time

import msgspec

from agent.errors import BadInput
from agent.job.atomicfile import write_atomic
from agent.job.names import agent_name, agent_names
from agent.job.paths import JobDir

POOL_SCHEMA = 1
# The most decodes a pool may have (``scale --decode N``, ``roles.*.nodes``; one number for both):
# the head follows every agent with a long poll and a view of its state, and has been measured
# following 1,024 peers within its targets (docs/performance.md, "The head at scale"). Past that
# nothing says it keeps up, and a larger count is a typo (``--decode 10000``), not a cluster.
MAX_DECODES = 1024


class GrowJob(msgspec.Struct, kw_only=True):
    """A Slurm job started to grow the pool: its id and the decode indexes its agents take."""

    slurm_job_id: str
    indexes: list[int]


class DecodePool(msgspec.Struct, kw_only=True):
    """The decode agents the job should have, by index, and the Slurm jobs that grew it."""

    schema: int = POOL_SCHEMA
    decode: list[int]
    # Slurm only: every job started by ``scale`` for this job folder (``stop`` ends them too).
    grow_jobs: list[GrowJob] = []
    updated_at: float = msgspec.field(default_factory=time.time)

    @property
    def names(self) -> list[str]:
        """The decode agents' names, by index."""
        return [agent_name("decode", i) for i in sorted(self.decode)]


class PoolFileError(BadInput, ValueError):
    """``J/pool.json`` cannot be used; the message says why."""


def planned_pool(workers: int) -> DecodePool:
    """The pool as the plan made it: decodes 0 .. workers - 1."""
    return DecodePool(decode=list(range(workers)), updated_at=0.0)


def decode_pool(data: bytes) -> DecodePool:
    """Parse ``pool.json``; ``PoolFileError`` for anything that is not one."""
    try:
        pool = msgspec.json.decode(data, type=DecodePool)
    except msgspec.DecodeError as exc:
        raise PoolFileError(f"not a pool file: {exc}") from None
    if pool.schema != POOL_SCHEMA:
        raise PoolFileError(f"schema {pool.schema}, this agent reads {POOL_SCHEMA}")
    if not pool.decode or len(set(pool.decode)) != len(pool.decode) or min(pool.decode) < 0:
        raise PoolFileError(f"decode must be distinct indexes >= 0, at least one: {pool.decode}")
    if len(pool.decode) > MAX_DECODES:
        raise PoolFileError(f"{len(pool.decode)} decodes, at most {MAX_DECODES}")
    return pool


def read_pool(job: JobDir, workers: int) -> DecodePool:
    """The pool asked for now: ``pool.json``, else the plan's ``workers`` decodes.

    ``PoolFileError`` when the file is there but unusable (OSError when it cannot be read)."""
    try:
        data = job.pool.read_bytes()
    except FileNotFoundError:
        return planned_pool(workers)
    return decode_pool(data)


def write_pool(job: JobDir, pool: DecodePool) -> None:
    """Write ``pool.json`` atomically (0644: every agent reads it)."""
    pool.updated_at = time.time()
    write_atomic(job.pool, msgspec.json.encode(pool), mode=0o644)


def resized(pool: DecodePool, count: int, leave: list[int]) -> tuple[list[int], list[int]]:
    """The indexes to add and to remove for a pool of ``count`` decodes: the ``leave`` ones (named
    by the user) first, then the highest; new ones take the lowest free indexes."""
    current = sorted(pool.decode)
    if count < len(current):
        going = [i for i in leave if i in current][: len(current) - count]
        rest = [i for i in reversed(current) if i not in going]
        going += rest[: len(current) - count - len(going)]
        return [], sorted(going)
    adding: list[int] = []
    index = 0
    while len(current) + len(adding) < count:
        if index not in current:
            adding.append(index)
        index += 1
    return adding, []


def every_agent(job: JobDir, prefill: int, decode: int) -> set[str]:
    """The plan's agents and every decode the pool names (an unreadable pool adds none)."""
    names = set(agent_names(prefill, decode))
    with contextlib.suppress(OSError, PoolFileError):
        names.update(read_pool(job, decode).names)
    return names
