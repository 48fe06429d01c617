"""The conversion's part of the plan, and the plan of a ``tilert-submit convert`` job.

A serving job with ``roles.decode.convert`` carries a ``ConvertPlan``: each decode agent converts
its weights folder (exactly once per folder, docs/weights.md) before it starts its engine. A convert
job is the same plan cut down to that step: one decode agent on one node, no prefill, no GPU (the
converter runs on the CPU), ending when the folder is complete.
"""

from __future__ import annotations

import msgspec

from agent.facts import CONVERTER_MODULE
from agent.job.plan import ConvertPlan, Plan
from agent.problems import InputError, error
from agent.recipe.model import Recipe
from agent.recipe.rules.weights import CONVERT, converter_model_type

# Appended to the recipe name for a convert job (its Slurm job name and job directory).
CONVERT_JOB_SUFFIX = "-convert"


def convert_plan(recipe: Recipe) -> ConvertPlan | msgspec.UnsetType:
    """The ``ConvertPlan`` of a validated recipe; UNSET without ``roles.decode.convert``."""
    decode = recipe.roles.decode
    if decode is None or decode.convert is None:
        return msgspec.UNSET
    convert = decode.convert
    return ConvertPlan(
        source=convert.source or "",
        model_type=converter_model_type(decode) or "",
        append_mtp=convert.append_mtp,
        program=[convert.python, "-m", CONVERTER_MODULE],
        budget_s=recipe.agent.convert_budget_s,
        lock_stale_s=recipe.agent.convert_lock_stale_s,
    )


def convert_job_plan(plan: Plan) -> Plan:
    """The plan of a convert-only job: decode-0 alone on one node, without GPUs."""
    if isinstance(plan.convert, msgspec.UnsetType):
        raise InputError(
            [
                error(
                    CONVERT,
                    "the recipe says nothing about converting weights",
                    "add roles.decode.convert with source (the checkpoint) to the recipe "
                    "(docs/weights.md)",
                )
            ]
        )
    replace = msgspec.structs.replace
    decode = replace(plan.decode, nodes=1, workers=1, first_node=0, gpus_per_worker=0)
    return replace(
        plan,
        name=plan.name + CONVERT_JOB_SUFFIX,
        prefill=replace(plan.prefill, nodes=0, workers=0),
        decode=decode,
        slurm=replace(plan.slurm, nodes=1, gpus_per_node=0),
        convert=replace(plan.convert, only=True),
    )
