"""Rules for the ``service:`` section and what a service needs of the rest of the recipe
(docs/service.md, docs/recipe.md "The service: section").

``service`` runs at load on every recipe (a key is checked wherever it is written, as every other
key is): ``slurm.time_limit`` is a Slurm time, ``service.front.host`` an address to bind, the
replacement backoff in order. ``serving`` is what ``tilert-submit serve`` adds, knowing the
cluster's signal lead and whether the cells run here (``--local``): cells that would get their
TERM as they start, a successor that would come after its predecessor stopped serving, a cell
that would end after its benchmark.
The checks that need two ``service:`` keys at once (``max_cells``, the lead shorter than the
limit) are ``agent.recipe.serviceplan``'s.
"""

from __future__ import annotations

import re

from agent.problems import Problem, error
from agent.recipe.model import Recipe
from agent.recipe.rules.benchmark import keeps_serving
from agent.recipe.serviceplan import slurm_limit_s, slurm_seconds

# A host name (RFC 1123 labels) or an IPv4/IPv6 address: what the service front binds.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+$")


def service(recipe: Recipe, out: list[Problem]) -> None:
    """The ``service:`` keys and ``slurm.time_limit`` (load time, every recipe)."""
    text = recipe.slurm.time_limit
    if text is not None:
        try:
            slurm_seconds(text)
        except ValueError:
            out.append(
                error(
                    "slurm.time_limit",
                    f"{text!r} is not a Slurm time",
                    "write minutes, minutes:seconds, H:MM:SS or D-HH[:MM[:SS]] (sbatch --time), "
                    "e.g. '4:00:00', or UNLIMITED",
                )
            )
    host = recipe.service.front.host
    if not (_HOST.match(host) or (":" in host and _IPV6.match(host))):
        out.append(
            error(
                "service.front.host",
                f"{host!r} is not a host name or an IP address to listen on",
                "give an address only, no scheme or port (the port is service.front.port): "
                "127.0.0.1 for this machine, 0.0.0.0 for every interface",
            )
        )
    replace = recipe.service.replace
    if replace.backoff_s > replace.backoff_max_s:
        out.append(
            error(
                "service.replace.backoff_s",
                f"{replace.backoff_s:g} s is more than service.replace.backoff_max_s "
                f"({replace.backoff_max_s:g} s)",
                "set backoff_s at most backoff_max_s (the first wait, doubled up to the most)",
            )
        )


def serving(recipe: Recipe, *, signal_lead_s: int) -> list[Problem]:
    """What ``tilert-submit serve`` refuses beyond the load-time rules: ``signal_lead_s`` is the
    cluster file's (the cells' ``--signal=TERM@lead``)."""
    out: list[Problem] = []
    limit = slurm_limit_s(recipe.slurm.time_limit)
    if limit is not None and limit <= signal_lead_s:
        out.append(
            error(
                "slurm.time_limit",
                f"{recipe.slurm.time_limit!r} ({limit:g} s) is not longer than the signal lead "
                f"({signal_lead_s} s): every cell would get its TERM as it starts",
                "set a longer slurm.time_limit, or a shorter signal_lead_s in the cluster file",
            )
        )
    lead = recipe.service.successor_lead_s
    if isinstance(lead, float | int) and limit is not None and lead <= signal_lead_s:
        out.append(
            error(
                "service.successor_lead_s",
                f"{lead:g} s is not longer than the signal lead ({signal_lead_s} s): a cell "
                "stops serving at its TERM, before its successor would even be submitted",
                f"set it to the signal lead plus a cell's submit-to-ready time (more than "
                f"{signal_lead_s} s), or 'auto'",
            )
        )
    if not keeps_serving(recipe.benchmark):
        out.append(
            error(
                "benchmark.keep_serving",
                f"a {recipe.benchmark.type} benchmark ends its cell once it has run (keep_serving "
                "is false): the service would replace it again and again",
                "set benchmark.keep_serving: true, or benchmark.type: manual (benchmark the "
                "service from outside: tilert-submit bench, docs/benchmark.md)",
            )
        )
    return out
