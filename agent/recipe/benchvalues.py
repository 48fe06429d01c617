"""``benchmark:`` values given outside a recipe (``tilert-submit bench``'s flags), checked by the
recipe's own rules: the same types, ranges and messages as in a recipe file (docs/benchmark.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from agent.problems import Problem
from agent.recipe.model import Benchmark
from agent.recipe.rules.benchmark import aiperf_values
from agent.recipe.typedyaml import ShapeChecker, convert_problem


def check_benchmark_values(values: dict[str, Any]) -> list[Problem]:
    """Every problem of ``values`` (``benchmark:`` keys, an aiperf benchmark's), each at
    ``benchmark.KEY``; only the keys given are checked."""
    checker = ShapeChecker()
    _, cleaned = checker.check(
        {"type": "aiperf", **values}, msgspec.inspect.type_info(Benchmark), ("benchmark",)
    )
    if checker.problems:
        return checker.problems
    try:
        bench = msgspec.convert(cleaned, Benchmark)
    except msgspec.ValidationError as exc:  # the walker should have caught it
        return [convert_problem(exc)]
    out: list[Problem] = []
    aiperf_values(bench, out, partial=True)
    return out
