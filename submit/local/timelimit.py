"""``slurm.time_limit`` under ``--local``, as Slurm applies it (docs/cli.md, "The time limit").

Slurm counts a job's limit in whole minutes (seconds round up to the next one) from the job's
start, sends ``--signal=TERM@lead`` (``signal_lead_s``, the cluster file's) that many seconds
before the end, and ends whatever still runs at the end. The local supervisor does the same from
its own start (``status.json`` ``local_started_at``): every agent gets SIGTERM at the lead (they
drain, as under Slurm), anything left at the limit is killed, and status.json's ``ended_by``
says ``time_limit``. So a service's cells see real successions on one machine in minutes.

Slurm may signal up to 60 s earlier than asked; the local supervisor signals exactly at the lead.
"""

from __future__ import annotations

import time

from agent.job.plan import Plan
from agent.recipe.serviceplan import slurm_limit_s


def time_limit_s(plan: Plan) -> float | None:
    """The job's ``slurm.time_limit`` in seconds as Slurm keeps it (whole minutes); None when
    there is none."""
    return slurm_limit_s(plan.slurm.time_limit)


def ends_at(plan: Plan, started_at: float | None) -> float | None:
    """When a local job whose supervisor started at ``started_at`` (wall clock, status.json's
    ``local_started_at``) reaches its time limit; None without a limit or a start."""
    limit = time_limit_s(plan)
    if limit is None or started_at is None:
        return None
    return started_at + limit


def time_left_s(plan: Plan, started_at: float | None, now: float | None = None) -> float | None:
    """A local job's time left (as Slurm's ``squeue -o %L`` says it for a Slurm job), >= 0;
    None without a limit."""
    end = ends_at(plan, started_at)
    if end is None:
        return None
    return max(0.0, end - (time.time() if now is None else now))


def limit_text(plan: Plan) -> str:
    """The limit as users read it: ``slurm.time_limit 2 (120s), TERM 30s before``."""
    limit = time_limit_s(plan)
    return (
        f"slurm.time_limit {plan.slurm.time_limit} ({limit:g}s), "
        f"TERM {plan.slurm.signal_lead_s}s before"
    )
