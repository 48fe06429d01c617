"""``tilert-submit stop J``: stop a job so that its agents drain and nothing is left.

The job's backend (``submit.backend``) does the stopping: on Slurm a ``scancel --signal=TERM``
that reaches every agent, locally a SIGTERM to the ``--local`` supervisor once its pid is proven
to be that supervisor (a stale job directory's pid may name a stranger). Either way the agents
get the plan's drain time (``Plan.drain_s``) before anything is killed.
"""

from __future__ import annotations

import argparse
import sys

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.job.records import JobStatus
from submit.backend import BackendError, nothing_to_stop
from submit.choice import backend_of
from submit.statusview import open_job, read_plan, read_status


def main(args: argparse.Namespace) -> int:
    """Stop the job; 0 also when it had already stopped."""
    job = open_job(args.job_dir)
    status: JobStatus = read_status(job)
    limit = read_plan(job).drain_s()
    backend = backend_of(status)
    if backend is None:
        print(nothing_to_stop(status))
        return EXIT_OK
    if backend.is_running(status) is False:
        print(backend.not_running(status))
        return EXIT_OK
    try:
        backend.stop(job, status, limit)
    except BackendError as exc:
        print(f"tilert-submit: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK
