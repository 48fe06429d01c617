"""``tilert-submit stop S``: stop a service so that nothing is left: its front, every cell.

The service front stops its own cells when it gets SIGTERM (each drains, then the front exits),
so ``stop`` signals it first when it still runs here: the pid service.json names, only while
that pid still started when the front did (``front_started_at``) and runs ``serve`` (a stale
service.json's pid may name a stranger by now). Whatever the front leaves (it was SIGKILLed
earlier, it ran on another host, it did not finish in time) is stopped cell by cell, through each
cell's job directory as ``stop J`` does: every directory under ``S/cells/``, also one the front
had not recorded yet. Exit 0 when nothing of the service runs any more, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
from pathlib import Path

import msgspec

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.service.paths import ServiceDir
from agent.service.records import ServiceStatus
from submit.backend import BackendError
from submit.choice import backend_of
from submit.local.backend import START_TIME_SLACK_S, process_facts
from submit.servicestatus import front_alive, read_service, staleness

# A cell's drain when its plan cannot be read; and what the front may take beyond its cells'
# drains (it stops them all at once) before it is killed and the cells are stopped from here.
DEFAULT_DRAIN_S = 60.0
FRONT_SLACK_S = 10.0


def cell_dirs(service: ServiceDir) -> list[JobDir]:
    """Every cell's job directory under ``S/cells/`` (recorded in service.json or not)."""
    try:
        names = sorted(p.name for p in service.cells.iterdir() if (p / "status.json").is_file())
    except OSError:
        return []
    return [service.cell(name) for name in names]


def drain_of(job: JobDir) -> float:
    """How long a cell may take to drain (its plan's); a default when its plan is unreadable."""
    try:
        return load_plan(job.plan.read_bytes()).drain_s()
    except (OSError, ValueError, msgspec.DecodeError):
        return DEFAULT_DRAIN_S


def not_the_front(status: ServiceStatus) -> str | None:
    """Why the live pid service.json names is not this service's front, or None when it is."""
    facts = process_facts(status.front_pid)
    if isinstance(facts, str):
        return facts
    started, cmdline = facts
    if abs(started - status.front_started_at) > START_TIME_SLACK_S:
        return f"pid {status.front_pid} started after the service front did: another process now"
    if "serve" not in cmdline:
        return f"pid {status.front_pid} does not run tilert-submit serve"
    return None


def stop_front(status: ServiceStatus, limit: float) -> bool:
    """SIGTERM the service front (it drains and stops its cells) and wait up to ``limit``;
    SIGKILL it past that. Whether it ended by itself (its cells then are stopped)."""
    pid = status.front_pid
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        why = not_the_front(status)
        if why is not None:
            print(f"not signalling pid {pid}: {why}; stopping the cells one by one")
            return False
        print(f"stopping the service front: SIGTERM to pid {pid} (up to {limit:g}s)", flush=True)
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        readable, _, _ = select.select([pidfd], [], [], limit)
        if readable:
            print("the service front stopped")
            return True
        print(f"pid {pid} did not exit within {limit:g}s; sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return False
    finally:
        os.close(pidfd)


def stop_cell(job: JobDir) -> bool:
    """Stop one cell as ``stop J`` does; whether nothing of it runs any more."""
    try:
        status = job.read_status()
    except (OSError, msgspec.DecodeError) as exc:
        print(f"{job.root.name}: cannot read its status.json ({exc}); not stopped")
        return False
    backend = backend_of(status)
    if backend is None or backend.is_running(status) is False:
        return True
    print(f"{job.root.name}: ", end="", flush=True)
    try:
        backend.stop(job, status, drain_of(job))
    except BackendError as exc:
        print(f"tilert-submit: {job.root.name}: {exc}", file=sys.stderr)
        return False
    return True


def main(args: argparse.Namespace) -> int:
    """Stop the service's front, then whatever of its cells still runs; 0 when nothing is left."""
    service = ServiceDir(Path(args.job_dir))
    status = read_service(service)
    cells = cell_dirs(service)
    alive = front_alive(status)
    if alive is None and staleness(status) is None:
        # A front elsewhere would replace every cell stopped from here.
        print(
            f"tilert-submit: the service front runs on {status.front_host} (pid "
            f"{status.front_pid}): run tilert-submit stop {service.root} there",
            file=sys.stderr,
        )
        return EXIT_RUNTIME
    if alive:
        stop_front(status, max((drain_of(job) for job in cells), default=0.0) + FRONT_SLACK_S)
    stopped = [stop_cell(job) for job in cells]
    if all(stopped):
        print(f"service stopped: {len(cells)} cell(s), none running")
        return EXIT_OK
    return EXIT_RUNTIME
