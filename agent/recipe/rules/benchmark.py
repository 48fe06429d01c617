"""Load-time rules for ``benchmark:``: the type, its keys, their values, and the readers the
planner uses (levels, request rate, tokenizer, keep_serving) so both read them one way.

Like srtctl, a key the chosen type does not use is an error naming the keys it accepts (a silent
no-op is how a benchmark "succeeds" measuring something else). TileRT 0.1.6 serves streaming
``/v1/chat/completions`` only and has no ``/v1/models``: the types that need more are refused with
the reason (docs/benchmark.md).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from agent.problems import Problem, error
from agent.recipe.model import Benchmark, Recipe, find_arg
from agent.recipe.rules.values import program_path

B = "benchmark"
TYPES = ("manual", "aiperf", "custom")
PLACEMENTS = ("head", "last_decode")
DEFAULT_AIPERF_COMMAND = "aiperf"
# Keys each type reads (``type`` aside); any other key set is refused.
_SHARED = ("container_image", "client_placement", "env", "keep_serving", "timeout_s")
TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "manual": (),
    "aiperf": (
        "isl",
        "osl",
        "concurrencies",
        "req_rate",
        "num_requests",
        "duration_s",
        "warmup_requests",
        "tokenizer",
        "extra_args",
        "max_error_rate",
        "aiperf_command",
        *_SHARED,
    ),
    "custom": ("command", "require_results", *_SHARED),
}
# srtctl's benchmark types and why each cannot run against TileRT 0.1.6.
_OTHER_TYPES = {
    "sa-bench": "it sends streaming /v1/completions, which TileRT 0.1.6 does not serve",
    "sglang-bench": "it sends streaming /v1/completions, which TileRT 0.1.6 does not serve",
    "gpqa": "its model discovery needs /v1/models, which TileRT 0.1.6 does not have",
    "mmlu": "its model discovery needs /v1/models, which TileRT 0.1.6 does not have",
    "longbenchv2": "its model discovery needs /v1/models, which TileRT 0.1.6 does not have",
    "router": "it needs frontend.type sglang-router",
    "mooncake-router": "it needs a KV-aware router",
}
# aiperf flags the agent sets itself from the job and the keys above.
MANAGED_AIPERF_FLAGS = (
    "--model",
    "-m",
    "--model-names",
    "--url",
    "-u",
    "--endpoint-type",
    "--endpoint",
    "--custom-endpoint",
    "--streaming",
    "--tokenizer",
    "--concurrency",
    "--request-count",
    "--num-requests",
    "--benchmark-duration",
    "--request-rate",
    "--warmup-request-count",
    "--num-warmup-requests",
    "--isl",
    "--osl",
    "--synthetic-input-tokens-mean",
    "--prompt-input-tokens-mean",
    "--output-tokens-mean",
    "--prompt-output-tokens-mean",
    "--artifact-dir",
    "--output-artifact-dir",
    "--server-metrics",
)


def benchmark_type(bench: Benchmark) -> str:
    """The type, ``manual`` when unset."""
    return bench.type or "manual"


def set_keys(bench: Benchmark) -> list[str]:
    """The keys the recipe sets (other than ``type``), in declaration order."""
    default = msgspec.structs.asdict(Benchmark())
    given = msgspec.structs.asdict(bench)
    return [k for k, v in given.items() if k != "type" and v != default[k]]


def concurrency_levels(value: list[int] | str | None) -> list[int] | None:
    """The levels of ``concurrencies`` (a list, or srtctl's "1x4x16"); None when unreadable."""
    if value is None:
        return []
    if isinstance(value, list):
        return list(value)
    parts = value.lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def request_rate(value: float | str | None) -> float | None:
    """``req_rate`` as requests per second; None for "inf" or unset (as fast as allowed)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "inf"):
        return None
    if isinstance(value, str):
        raise ValueError(value)
    return None if math.isinf(value) else float(value)


def tokenizer_of(recipe: Recipe) -> str | None:
    """The client's tokenizer: ``benchmark.tokenizer``, else ``frontend.args.model-path``."""
    if recipe.benchmark.tokenizer:
        return recipe.benchmark.tokenizer
    found = find_arg(recipe.frontend.args, "model-path")
    return found[1] if found and isinstance(found[1], str) and found[1] else None


def keeps_serving(bench: Benchmark) -> bool:
    """Whether the job keeps serving after its benchmark (manual: always; else default false)."""
    if benchmark_type(bench) == "manual":
        return True
    return bool(bench.keep_serving)


def benchmark(recipe: Recipe, out: list[Problem]) -> None:
    """Every problem of the ``benchmark:`` section."""
    bench = recipe.benchmark
    kind = benchmark_type(bench)
    if kind not in TYPES:
        why = _OTHER_TYPES.get(kind)
        out.append(
            error(
                f"{B}.type",
                f"benchmark type {kind!r} cannot run here"
                + (f": {why}" if why else f"; tilert-agent runs {', '.join(TYPES)}"),
                "use type: aiperf (streaming chat through the router), or type: custom with a "
                "client that sends streaming /v1/chat/completions with an explicit model name",
            )
        )
        return
    allowed = TYPE_KEYS[kind]
    for key in set_keys(bench):
        if key in allowed:
            continue
        if kind == "manual" and key == "keep_serving":
            message = "type manual runs nothing and serves until stopped"
        else:
            message = f"'{key}' is not used by benchmark type {kind}"
        keys = ", ".join(allowed) or "none besides type"
        out.append(error(f"{B}.{key}", message, f"remove it (type {kind} reads: {keys})"))
    if bench.client_placement is not None and bench.client_placement not in PLACEMENTS:
        out.append(
            error(
                f"{B}.client_placement",
                f"unknown placement {bench.client_placement!r}",
                "use head (the default: the client runs on the head's node) or last_decode",
            )
        )
    if kind == "aiperf":
        _aiperf(recipe, bench, out)
    elif kind == "custom" and not (bench.command or "").strip():
        out.append(
            error(
                f"{B}.command",
                "type custom needs a command",
                'set command: "my-client --url $TILERT_BENCH_URL --model $TILERT_BENCH_MODEL" '
                "(docs/benchmark.md lists its environment)",
            )
        )


def _required(path: str, value: int | None, out: list[Problem]) -> None:
    if value is None:
        out.append(error(path, "type aiperf needs it", f"set {path.split('.')[-1]}: 128"))


def _aiperf(recipe: Recipe, bench: Benchmark, out: list[Problem]) -> None:
    # Numbers are in range already (their types in the model); the string forms are read here.
    _required(f"{B}.isl", bench.isl, out)
    _required(f"{B}.osl", bench.osl, out)
    aiperf_values(bench, out)
    if tokenizer_of(recipe) is None:
        out.append(
            error(
                f"{B}.tokenizer",
                "AIPerf needs a tokenizer to make prompts of isl tokens, and neither "
                "benchmark.tokenizer nor frontend.args.model-path names one",
                "set benchmark.tokenizer to the model's tokenizer (a path or a hub id)",
            )
        )


def aiperf_values(bench: Benchmark, out: list[Problem], *, partial: bool = False) -> None:
    """The problems of an aiperf benchmark's own values (its levels, its bounds, its rate, its
    flags); ``partial``: only the keys set are checked (``tilert-submit bench``'s flags, on top
    of a recipe's)."""
    if partial and bench.concurrencies is None:
        levels: list[int] | None = [1]
    else:
        levels = concurrency_levels(bench.concurrencies)
    if levels is None:
        out.append(
            error(
                f"{B}.concurrencies",
                f"{bench.concurrencies!r} is not a list of levels",
                'write a list like [1, 4, 16], or srtctl\'s "1x4x16"',
            )
        )
    elif not levels:
        out.append(
            error(f"{B}.concurrencies", "type aiperf needs at least one level", "set [1, 4, 16]")
        )
    else:
        for i, level in enumerate(levels):
            if level < 1:
                out.append(
                    error(f"{B}.concurrencies[{i}]", f"{level} is not a level", "use 1 or more")
                )
        dups = sorted({v for v in levels if levels.count(v) > 1})
        if dups:
            out.append(
                error(
                    f"{B}.concurrencies",
                    f"level {', '.join(map(str, dups))} is listed twice",
                    "list each concurrency once (each level has one result folder)",
                )
            )
    if bench.num_requests is not None and bench.duration_s is not None:
        out.append(
            error(
                f"{B}.duration_s",
                "num_requests and duration_s both set: a level ends on one of them",
                "keep one",
            )
        )
    try:
        request_rate(bench.req_rate)
    except ValueError:
        out.append(
            error(f"{B}.req_rate", f"{bench.req_rate!r} is not a rate", 'use a number or "inf"')
        )
    if bench.aiperf_command is not None and not bench.aiperf_command.strip():
        out.append(error(f"{B}.aiperf_command", "empty command", "remove it for `aiperf` on PATH"))
    elif bench.aiperf_command is not None:
        program_path(f"{B}.aiperf_command", bench.aiperf_command, out)
    _extra_args(bench.extra_args, out)


def _extra_args(args: list[Any], out: list[Problem]) -> None:
    for i, arg in enumerate(args):
        flag = str(arg).split("=", 1)[0]
        if flag in MANAGED_AIPERF_FLAGS:
            out.append(
                error(
                    f"{B}.extra_args[{i}]",
                    f"{flag} is set by the agent (from the job and the benchmark keys)",
                    "use the benchmark keys (isl, osl, concurrencies, ...) and remove it",
                )
            )
