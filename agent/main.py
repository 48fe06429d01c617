"""``tilert-agent --role {prefill,decode} --job-dir J [--index N]``: one agent per node."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from pathlib import Path

import msgspec
import trio

from agent.errors import EXIT_BAD_INPUT
from agent.job.logfiles import log_path
from agent.job.paths import JOB_DIR_ENV, JobDir
from agent.job.plan import load_plan
from agent.job.pool import PoolFileError, read_pool
from agent.job.vocab import ROLES, as_role
from agent.node.agentlog import setup_agent_logging
from agent.node.identity import IdentityError, resolve_identity
from agent.node.secretenv import say_missing_secrets
from agent.problems import InputError, printable
from agent.recipe.loader import load_recipe


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tilert-agent",
        description="Supervise one node's engine (vLLM prefill or TileRT decode) of a tilert job.",
    )
    p.add_argument("--role", required=True, choices=ROLES, help="this node's role")
    p.add_argument("--job-dir", required=True, help="the job directory tilert-submit created")
    p.add_argument(
        "--index",
        type=int,
        default=None,
        help="index within the role (default: $SLURM_PROCID, else 0)",
    )
    return p


def _fail(message: str, details: str = "") -> int:
    # One line: paths and values from the job directory are escaped. ``details`` (rendered
    # problems, which escape their own values) follow on lines of their own.
    print(f"tilert-agent: {printable(message)}", file=sys.stderr)
    if details:
        print(details, file=sys.stderr)
    return EXIT_BAD_INPUT


def _in_pool(job: JobDir, role: str, index: int, workers: int) -> bool:
    """Whether ``J/pool.json`` (``tilert-submit scale``) names this decode beyond the plan's."""
    if role != "decode":
        return False
    try:
        return index in read_pool(job, workers).decode
    except (OSError, PoolFileError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 on a requested stop, 1 when the job failed, 2 on bad input."""
    # How to see where it is stuck: kill -USR1 <pid> prints every thread's stack on stderr
    # (docs/agent.md).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # And as it dies of SIGABRT (systemd's watchdog: docs/systemd.md), SIGSEGV or the like: the
    # stacks show where its loop was wedged.
    faulthandler.enable(all_threads=True)
    args = _parser().parse_args(argv)
    try:
        job = JobDir(Path(args.job_dir).resolve())
        found = job.plan.is_file()
    except (OSError, RuntimeError) as exc:  # a 300-character component, a symlink loop, EACCES
        return _fail(f"--job-dir {args.job_dir}: {getattr(exc, 'strerror', None) or exc}")
    if not found:
        return _fail(f"--job-dir {args.job_dir}: no plan.json there; create it with tilert-submit")
    try:
        plan = load_plan(job.plan.read_bytes())
    except OSError as exc:
        return _fail(f"{job.plan}: cannot read it ({exc.strerror or exc})")
    except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
        return _fail(f"{job.plan}: unusable plan ({exc}); re-create the job with tilert-submit")
    try:
        # Defence in depth (and for systemd use): the same rules the submitter ran.
        load_recipe(job.recipe, on_submit_host=False)
    except InputError as exc:
        return _fail(f"{job.recipe} does not validate:", str(exc))
    try:
        identity = resolve_identity(as_role(args.role), args.index, plan.network_interface)
    except IdentityError as exc:
        return _fail(str(exc))
    workers = plan.role(identity.role).workers
    if identity.index >= workers and not _in_pool(job, identity.role, identity.index, workers):
        return _fail(
            f"{identity.name}: index {identity.index} but the plan has {workers} {identity.role} "
            f"worker(s) and {job.pool} does not name it; check --index / SLURM_PROCID"
        )
    log = setup_agent_logging(log_path(job, identity.name, agent=True), name=identity.name)
    # Started by hand, by systemd or for a rejoin, it has the secrets its shell or unit gave it.
    say_missing_secrets(
        plan, identity.role, os.environ, log, who=identity.name, head=identity.is_head
    )
    # Everything this agent starts carries its job: the node check of a later job finds what an
    # ended one left behind (agent.node.hygiene).
    os.environ[JOB_DIR_ENV] = str(job.root)
    if not isinstance(plan.convert, msgspec.UnsetType) and plan.convert.only:
        from agent.convertjob import ConvertJob

        return trio.run(ConvertJob(job=job, plan=plan, identity=identity, log=log).run)
    from agent.nodeagent import NodeAgent

    agent = NodeAgent(job=job, plan=plan, identity=identity, log=log)
    code = trio.run(agent.run)
    # Drained: Python restores the default action while it shuts down, and a late SIGTERM (a
    # second scancel, the submitter's stop) would turn this exit code into 143.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
