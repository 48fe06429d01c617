"""The benchmark's part of the plan: ``benchmark:`` resolved for the head (docs/benchmark.md).

``manual`` has none (the field stays absent from plan.json). Defaults are applied here, once:
``keep_serving`` false, ``client_placement`` head, ``timeout_s`` a day, ``require_results``
false, ``max_error_rate`` 0, ``aiperf`` on PATH, ``num_requests`` ten times the level when neither
it nor ``duration_s`` is set (at runtime), the tokenizer from ``frontend.args.model-path``.
"""

from __future__ import annotations

import msgspec

from agent.job.benchmark import BENCHMARK_TIMEOUT_S, BenchmarkPlan
from agent.recipe.model import Recipe
from agent.recipe.rules.benchmark import (
    DEFAULT_AIPERF_COMMAND,
    benchmark_type,
    concurrency_levels,
    keeps_serving,
    request_rate,
    tokenizer_of,
)


def benchmark_plan(
    recipe: Recipe, *, env: dict[str, str], secret_env: list[str], stop_grace_s: float
) -> BenchmarkPlan | msgspec.UnsetType:
    """The ``benchmark`` of plan.json (UNSET for ``manual``); the recipe passed the rules.

    ``env`` and ``secret_env``: the client's environment (recipe ``environment`` and
    ``benchmark.env``) as the planner splits every environment.
    """
    bench = recipe.benchmark
    kind = benchmark_type(bench)
    if kind == "manual":
        return msgspec.UNSET
    placement = bench.client_placement or "head"
    common = {
        "keep_serving": keeps_serving(bench),
        "image": bench.container_image,
        "placement": placement,
        "env": env,
        "secret_env": secret_env,
        "stop_grace_s": stop_grace_s,
        "timeout_s": bench.timeout_s or BENCHMARK_TIMEOUT_S,
    }
    if kind == "custom":
        return BenchmarkPlan(
            type="custom",
            command=bench.command,
            require_results=bool(bench.require_results),
            **common,  # type: ignore[arg-type]
        )
    return BenchmarkPlan(
        type="aiperf",
        program=[bench.aiperf_command or DEFAULT_AIPERF_COMMAND],
        isl=bench.isl,
        osl=bench.osl,
        concurrencies=concurrency_levels(bench.concurrencies) or [],
        req_rate=request_rate(bench.req_rate),
        num_requests=bench.num_requests,
        duration_s=bench.duration_s,
        warmup_requests=bench.warmup_requests or 0,
        tokenizer=tokenizer_of(recipe),
        extra_args=[str(a) for a in bench.extra_args],
        max_error_rate=bench.max_error_rate or 0.0,
        **common,  # type: ignore[arg-type]
    )
