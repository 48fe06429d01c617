"""AIPerf's command line for one level (``aiperf profile``, AIPerf 0.13).

What TileRT 0.1.6 needs from a client, spelled for AIPerf: streaming chat completions with the
public model name; ``ignore_eos`` so every reply is ``osl`` tokens long (the decode honours it,
the router forwards it); the server's own token counts (``--use-server-token-count``: the client's
tokenizer may split the reply differently than the model did, and the verdict counts tokens);
every agent's ``/metrics`` for its server-metrics collection; no terminal UI and no GPU telemetry
(it runs unattended, maybe on a node without GPUs). ``extra_args`` come last, as given.
"""

from __future__ import annotations

from pathlib import Path

from agent.benchmark.target import BenchTarget
from agent.job.benchmark import BenchmarkPlan

# Requests per level when neither num_requests nor duration_s is set: enough for percentiles.
REQUESTS_PER_CONCURRENCY = 10
MIN_DEFAULT_REQUESTS = 10
# Every level of every run generates the same prompts (comparable runs).
RANDOM_SEED = 0
# The names AIPerf gives its summary and its per-request records in the artifact folder.
EXPORT_FILE = "profile_export_aiperf.json"
RECORDS_FILE = "profile_export.jsonl"


def level_requests(plan: BenchmarkPlan, concurrency: int) -> int | None:
    """Requests one level sends: ``num_requests``, none when ``duration_s`` bounds it, else 10x."""
    if plan.num_requests is not None:
        return plan.num_requests
    if plan.duration_s is not None:
        return None
    return max(MIN_DEFAULT_REQUESTS, REQUESTS_PER_CONCURRENCY * concurrency)


def aiperf_argv(
    plan: BenchmarkPlan, target: BenchTarget, concurrency: int, results: Path
) -> list[str]:
    """``aiperf profile ...`` measuring ``target`` at ``concurrency``, writing into ``results``."""
    argv = [
        *plan.program,
        "profile",
        "--model",
        target.model,
        "--url",
        target.router_url,
        "--endpoint-type",
        "chat",
        "--endpoint",
        target.endpoint,
        "--streaming",
    ]
    if target.tokenizer:
        argv += ["--tokenizer", target.tokenizer]
    argv += [
        "--isl",
        str(plan.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(plan.osl),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--concurrency",
        str(concurrency),
    ]
    requests = level_requests(plan, concurrency)
    if requests is not None:
        argv += ["--request-count", str(requests)]
    if plan.duration_s is not None:
        argv += ["--benchmark-duration", f"{plan.duration_s:g}"]
    if plan.req_rate is not None:
        argv += ["--request-rate", f"{plan.req_rate:g}"]
    if plan.warmup_requests:
        argv += ["--warmup-request-count", str(plan.warmup_requests)]
    if target.metrics_urls:
        argv += ["--server-metrics", *target.metrics_urls]
    argv += [
        "--artifact-dir",
        str(results),
        "--random-seed",
        str(RANDOM_SEED),
        "--ui",
        "none",
        "--no-gpu-telemetry",
        *plan.extra_args,
    ]
    return argv
