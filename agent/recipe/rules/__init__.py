"""The load-time rules: everything the recipe alone says will fail, found before sbatch.

``check`` runs srtctl's own rules and the failures srtctl would see only on the nodes
(``srtctl``), then the prefill/decode agreements that TileRT checks only at the first request
(``agreements``), that the router renders chats as the prefill does (``chattemplate``), whether
the weights conversion agrees with the decode (``weights``), the ``benchmark:`` section
(``benchmark``) and the ``service:`` section (``service``; ``service.serving`` is what
``tilert-submit serve`` adds), reading values through ``values``. It returns every
problem, in a fixed order, so that one run reports all of them; the loader runs it on every
recipe, and every agent again on its node.

Arg keys are compared with ``_`` == ``-``; a problem names a key as the user wrote it. The TileRT
and vLLM facts the rules compare against live in ``agent.facts``.

May import ``agent.facts``, ``agent.problems``, ``agent.recipe.model`` and
``agent.recipe.serviceplan`` (Slurm's time format) only (the loader imports this package).
"""

from __future__ import annotations

from agent.problems import Problem
from agent.recipe.model import Recipe
from agent.recipe.rules import agreements, benchmark, chattemplate, service, srtctl, weights


def check(recipe: Recipe, *, launcher: str | None = None) -> list[Problem]:
    """Every load-time rule; ``launcher`` (the cluster's) decides whether images are required."""
    out: list[Problem] = []
    srtctl.identity(recipe, out)
    srtctl.engines(recipe, out)
    srtctl.frontend(recipe, out)
    srtctl.topology(recipe, out)
    srtctl.environment(recipe, out)
    srtctl.managed_args(recipe, out)
    prefill, decode = recipe.roles.prefill, recipe.roles.decode
    if prefill is not None and decode is not None:
        agreements.agreement(recipe, prefill, decode, out)
    if prefill is not None:
        chattemplate.chat_template(recipe, prefill, out)
    srtctl.model(recipe, out)
    srtctl.images(recipe, launcher, out)
    srtctl.settings(recipe, out)
    weights.conversion(recipe, out)
    benchmark.benchmark(recipe, out)
    service.service(recipe, out)
    return out
