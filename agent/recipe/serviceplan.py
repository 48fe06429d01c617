"""The recipe's ``service:`` section resolved into what the service front acts on (docs/service.md):
defaults applied once, the cells' time limit in seconds, and the checks that need two keys.

``tilert-submit serve`` shows it with ``--dry-run``; the cells themselves ignore the section.
"""

from __future__ import annotations

import math
import re

import msgspec

from agent.problems import InputError, Problem
from agent.recipe.model import Recipe

# ``successor_lead_s: auto``: the last cell's submit-to-ready time times this, plus the time the
# last successor waited in Slurm's queue (a load that took 10 min gets a 15 min lead).
SUCCESSOR_LEAD_FACTOR = 1.5
# Slurm's spellings of "no limit" (sbatch --time, squeue %l).
UNLIMITED = frozenset({"unlimited", "infinite", "not_set"})
# Slurm's resolution: a time limit is whole minutes.
MINUTE_S = 60.0
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class ServicePlan(msgspec.Struct, frozen=True, kw_only=True):
    """What ``tilert-submit serve`` keeps: the ``service:`` keys with their defaults applied."""

    cells: int
    max_cells: int
    host: str
    port: int
    # None: ``auto`` (measured, SUCCESSOR_LEAD_FACTOR).
    successor_lead_s: float | None
    drain_s: float
    replace_backoff_s: float
    replace_backoff_max_s: float
    replace_max_per_hour: int
    # The cells' ``slurm.time_limit`` in seconds; None: none set (a cell runs until stopped, or
    # until the partition's limit, which Slurm's time left then says).
    time_limit_s: float | None


def slurm_seconds(text: str) -> float | None:
    """Slurm's time format (``minutes``, ``minutes:seconds``, ``hours:minutes:seconds``,
    ``days-hours[:minutes[:seconds]]``) in seconds; None for no limit. ValueError if not one."""
    if text.strip().lower() in UNLIMITED:
        return None
    match = _TIME.match(text.strip())
    if match is None:
        raise ValueError(text)
    days, first, second, third = match.groups()
    if days is not None:
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return float(((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds)
    if third is not None:
        return float((int(first) * 60 + int(second)) * 60 + int(third))
    if second is not None:
        return float(int(first) * 60 + int(second))
    return float(int(first) * 60)


def slurm_limit_s(text: str | None) -> float | None:
    """A job's time limit (``slurm.time_limit``) in seconds as Slurm keeps it: seconds round up
    to whole minutes (sbatch's resolution); None for none, no limit, or not a Slurm time (the
    load-time rules refuse that one, naming the key)."""
    if text is None:
        return None
    try:
        seconds = slurm_seconds(text)
    except ValueError:
        return None
    return None if seconds is None else max(1.0, math.ceil(seconds / MINUTE_S)) * MINUTE_S


def service_plan(recipe: Recipe) -> ServicePlan:
    """``recipe.service`` resolved; InputError naming each key that cannot be served."""
    service = recipe.service
    problems: list[Problem] = []
    max_cells = service.max_cells if service.max_cells is not None else service.cells + 1
    if max_cells < service.cells + 1:
        problems.append(
            Problem(
                "service.max_cells",
                f"{max_cells} leaves no room for a successor beside {service.cells} serving cells",
                f"set service.max_cells to at least {service.cells + 1} (service.cells + 1), or "
                "remove it",
            )
        )
    # As Slurm keeps it: whole minutes (a '0:30' cell runs a minute). One that is not a Slurm
    # time was refused when the recipe loaded (agent.recipe.rules.service).
    limit = slurm_limit_s(recipe.slurm.time_limit)
    lead = service.successor_lead_s
    if isinstance(lead, float | int) and limit is not None and lead >= limit:
        problems.append(
            Problem(
                "service.successor_lead_s",
                f"{lead:g} s is not shorter than the cells' time limit ({limit:g} s)",
                "set a lead shorter than slurm.time_limit, or 'auto'",
            )
        )
    if problems:
        raise InputError(problems)
    return ServicePlan(
        cells=service.cells,
        max_cells=max_cells,
        host=service.front.host,
        port=service.front.port,
        successor_lead_s=None if lead == "auto" else float(lead),
        drain_s=service.drain_s,
        replace_backoff_s=service.replace.backoff_s,
        replace_backoff_max_s=service.replace.backoff_max_s,
        replace_max_per_hour=service.replace.max_per_hour,
        time_limit_s=limit,
    )
