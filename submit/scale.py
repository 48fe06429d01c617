"""``tilert-submit scale J --decode N [--leave NAME ...]``: grow or shrink a serving job's decode
pool (docs/cli.md, "Scaling the decode pool").

``--decode N`` is at most ``MAX_DECODES`` (agent.job.pool), checked before anything is read. Under
``J/pool.lock`` (``submit.poollock``: a second ``scale`` meanwhile exits 1, never losing an update)
it reads and writes ``J/pool.json`` (atomically; ``agent.job.pool``), then starts the new agents
where the job runs: the ``--local`` supervisor sees the file and starts them itself; on Slurm a
second Slurm job for the same job folder runs them (``SlurmBackend.grow``, ``submit.slurm.render``).
The head proves each new decode by its canary before the router is restarted with it; a shrink takes
the named (``--leave``) or the highest-index decodes out of the router first, and each then drains
and stops. It waits until ``status.json`` shows the pool as asked (exit 0), or says what is still
moving when its limit passes (exit 1).
"""

from __future__ import annotations

import argparse
import sys
import time

import msgspec

from agent.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME
from agent.job.names import parse_agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.pool import (
    MAX_DECODES,
    DecodePool,
    PoolFileError,
    read_pool,
    resized,
    write_pool,
)
from agent.job.records import JobStatus
from agent.job.vocab import SERVING_STATES
from agent.problems import printable
from submit import PROG
from submit.backend import BackendError
from submit.choice import backend_of
from submit.poollock import PoolBusy, pool_lock
from submit.statusview import open_job, read_plan, read_status

POLL_S = 0.5
AGENT_START_S = 20.0  # the agents' own start (Python, imports) on a loaded machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``scale`` subcommand's arguments."""
    parser.add_argument("job_dir", metavar="J", help="the job directory tilert-submit printed")
    parser.add_argument(
        "--decode",
        type=int,
        required=True,
        metavar="N",
        help="the decode nodes the job should have",
    )
    parser.add_argument(
        "--leave",
        action="append",
        default=[],
        metavar="NAME",
        help="when shrinking, the decode that leaves first (e.g. decode-0; repeatable); "
        "default: the highest indexes",
    )


def _bad(message: str) -> int:
    print(f"{PROG} scale: {printable(message)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _leave_indexes(names: list[str], pool: DecodePool) -> list[int] | str:
    """The ``--leave`` names as pool indexes, or what is wrong with one."""
    out = []
    for name in names:
        parsed = parse_agent_name(name)
        if parsed is None or parsed[0] != "decode" or parsed[1] not in pool.decode:
            return (
                f"--leave {name}: not a decode of this job's pool "
                f"({', '.join(pool.names)}); name one of them"
            )
        out.append(parsed[1])
    return out


def scale_limit(plan: Plan, growing: bool) -> float:
    """How long ``scale`` waits for the pool to be as asked."""
    router = plan.router.startup_budget_s + plan.router.stop_grace_s
    if growing:
        # Start, load, a trial router and its canaries, then the router hand-over and its proof.
        work = plan.decode.startup_budget_s + router + 2 * plan.agent.canary_timeout_s
    else:
        # The router hand-over, then each leaving decode drains (bounded) and stops.
        work = router + plan.router.stop_grace_s + plan.decode.stop_grace_s
    return work + plan.agent.canary_timeout_s + AGENT_START_S


def pool_line(status: JobStatus) -> str:
    """Where the pool stands: each decode and its place (``decode-2 joining (healthy)``)."""
    rows = [a for a in status.agents if a.role == "decode"]
    return ", ".join(
        f"{a.name} {a.pool if isinstance(a.pool, str) else '?'} ({a.state})" for a in rows
    )


def settled(status: JobStatus, wanted: list[str], *, degraded_ok: bool = False) -> bool:
    """Whether ``status.json`` shows exactly ``wanted`` as members, nothing joining or leaving,
    and the job proven again: ``ready`` (``degraded`` too with ``degraded_ok``: it was before the
    scale, for another reason than the pool)."""
    rows = [a for a in status.agents if a.role == "decode"]
    members = sorted(a.name for a in rows if a.pool == "member")
    moving = [a for a in rows if a.pool in ("joining", "leaving")]
    router_ok = status.router is not None and status.router.state == "healthy"
    serving = status.state == "ready" or (degraded_ok and status.state == "degraded")
    return members == sorted(wanted) and not moving and router_ok and serving


def _wait(job: JobDir, wanted: list[str], limit: float, *, degraded_ok: bool) -> int:
    deadline = time.monotonic() + limit
    last = ""
    start = time.monotonic()
    while True:
        try:
            status = job.read_status()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            status = None
        if status is not None:
            line = f"{status.state}: {pool_line(status)}"
            if line != last:
                print(f"[{time.monotonic() - start:6.1f}s] {line}", flush=True)
                last = line
            if settled(status, wanted, degraded_ok=degraded_ok):
                print(f"the pool is {', '.join(wanted)}; job {status.state}")
                return EXIT_OK
            if status.state in ("failed", "stopped", "stopping"):
                print(f"{PROG} scale: the job is {status.state}: {status.error or ''}".rstrip(": "))
                return EXIT_RUNTIME
        if time.monotonic() > deadline:
            print(
                f"{PROG} scale: the pool is not as asked after {limit:g}s; last seen: {last}; "
                f"see tilert-submit status {job.root} and the head's agent.log",
                file=sys.stderr,
            )
            return EXIT_RUNTIME
        time.sleep(POLL_S)


def _resize(
    job: JobDir, status: JobStatus, plan: Plan, args: argparse.Namespace
) -> tuple[DecodePool, list[int]] | int:
    """Read the pool, write the one asked for, start its new agents (under ``J/pool.lock``): the
    pool wanted and the indexes added, or the exit code when nothing could be done."""
    try:
        pool = read_pool(job, plan.decode.workers)
    except PoolFileError as exc:
        return _bad(f"{job.pool}: {exc}; write it again with {PROG} scale or remove it")
    leave = _leave_indexes(args.leave, pool)
    if isinstance(leave, str):
        return _bad(leave)
    if status.state not in SERVING_STATES:
        print(
            f"{PROG} scale: the job is {status.state}; scale changes a serving job "
            "(ready or degraded): wait for it, see tilert-submit status",
            file=sys.stderr,
        )
        return EXIT_RUNTIME
    backend = backend_of(status)
    if backend is None:
        print(f"{PROG} scale: no backend runs this job (status.json)", file=sys.stderr)
        return EXIT_RUNTIME
    adding, removing = resized(pool, args.decode, leave)
    wanted = DecodePool(
        decode=sorted((set(pool.decode) - set(removing)) | set(adding)),
        grow_jobs=list(pool.grow_jobs),
    )
    if not adding and not removing:
        print(f"the pool already has {args.decode} decode(s): {', '.join(pool.names)}")
        return wanted, []
    what = "adding " + ", ".join(DecodePool(decode=adding).names) if adding else ""
    what += ("; " if what and removing else "") + (
        "taking out " + ", ".join(DecodePool(decode=removing).names) if removing else ""
    )
    print(f"scaling the decode pool of {job.root} to {args.decode}: {what}")
    write_pool(job, wanted)
    try:
        backend.grow(job, status, wanted, adding)
    except BackendError as exc:
        print(f"{PROG} scale: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return wanted, adding


def main(args: argparse.Namespace) -> int:
    """Write the new pool, start the new agents where the job runs, wait until it is so."""
    # Before anything is read or written: a count no pool may have is a typo.
    if args.decode < 1:
        return _bad(f"--decode {args.decode}: a job needs at least 1 decode; use stop to end it")
    if args.decode > MAX_DECODES:
        return _bad(
            f"--decode {args.decode}: at most {MAX_DECODES} decodes (the most peers the head has "
            f"been measured to follow, docs/performance.md); ask for 1 to {MAX_DECODES}"
        )
    job = open_job(args.job_dir)
    status = read_status(job)
    plan = read_plan(job)
    try:
        with pool_lock(job):
            done = _resize(job, status, plan, args)
    except PoolBusy as exc:
        print(f"{PROG} scale: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except OSError as exc:  # J/ read-only, full, or not ours: nothing was changed
        where = exc.filename or job.root
        print(f"{PROG} scale: {where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_RUNTIME
    if isinstance(done, int):
        return done
    wanted, adding = done
    limit = scale_limit(plan, bool(adding))
    return _wait(job, wanted.names, limit, degraded_ok=status.state == "degraded")
