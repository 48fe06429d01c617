"""The secrets this agent's processes expect from its environment, and those it lacks, said at
start.

A secret (``agent.job.secrets``: a name with ``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD``) is
never written into ``J/``: the plan keeps its name only, and the agent hands its own environment's
value to the process the recipe gives it to (``agent.launch.commands``). An agent started by the
job has them (``sbatch --export=ALL``, the ``--local`` supervisor); one started by hand, by systemd
or for a rejoin has what its shell or unit gave it, and an engine started without its
``HF_TOKEN`` fails minutes later, far from the cause. So the agent names each one missing, and who
needs it, as it starts (docs/agent.md, "Secrets of an agent started by hand").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from agent.job.plan import Plan
from agent.job.vocab import Role


def expected_secrets(plan: Plan, role: Role, *, head: bool) -> dict[str, list[str]]:
    """Each secret name the processes of this agent get from its environment -> those processes
    (its engine; the head's router and benchmark too)."""
    owners: list[tuple[str, list[str]]] = [(role, plan.role(role).secret_env)]
    if head:
        owners.append(("router", plan.router.secret_env))
        if not isinstance(plan.benchmark, msgspec.UnsetType):
            owners.append(("benchmark", plan.benchmark.secret_env))
    out: dict[str, list[str]] = {}
    for owner, names in owners:
        for name in names:
            out.setdefault(name, []).append(owner)
    return out


def missing_secrets(
    plan: Plan, role: Role, env: Mapping[str, str], *, head: bool
) -> dict[str, list[str]]:
    """The expected secrets ``env`` lacks (unset or empty) -> the processes that need them."""
    expected = expected_secrets(plan, role, head=head)
    return {name: who for name, who in sorted(expected.items()) if not env.get(name)}


def say_missing_secrets(
    plan: Plan, role: Role, env: Mapping[str, str], log: logging.Logger, *, who: str, head: bool
) -> list[str]:
    """Warn once for each secret the agent's environment lacks; their names."""
    missing = missing_secrets(plan, role, env, head=head)
    for name, owners in missing.items():
        log.warning(
            "%s: %s is not in this agent's environment, and the recipe gives it to its %s (a "
            "secret: never written in the job directory, passed on from the agent's environment); "
            "export it where the agent starts (its shell, or its systemd environment file) and "
            "restart the agent",
            who,
            name,
            " and ".join(owners),
        )
    return list(missing)
