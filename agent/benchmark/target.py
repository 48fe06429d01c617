"""What the client is pointed at: the running job as a benchmark client sees it.

The head builds a ``BenchTarget`` from its own knowledge (the router's URL, every agent's record)
and ``tilert-submit bench`` from ``status.json``; both hand it to the same runner. A custom
command gets it as environment variables (``client_env``): ours, and the srtctl names existing
scripts read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.job.benchmark import CHAT_ENDPOINT
from agent.job.plan import Plan


@dataclass(frozen=True)
class BenchTarget:
    """A ready job: where to send requests, which model, and what else to watch."""

    router_url: str
    model: str
    # The client's tokenizer (a path as the client sees it, or a hub id); None when unknown.
    tokenizer: str | None
    # Every agent's /metrics (AIPerf's server-metrics collection).
    metrics_urls: tuple[str, ...]
    # GPUs the job serves with (0: none, the stand-ins).
    gpus: int
    job_dir: Path
    endpoint: str = CHAT_ENDPOINT


def job_gpus(plan: Plan) -> int:
    """GPUs the job serves with: the prefill's and every decode's (0 for the stand-ins)."""
    return sum(role.workers * role.gpus_per_worker for role in (plan.prefill, plan.decode))


# Our variables for a custom command (docs/benchmark.md), then srtctl's.
ENV_URL = "TILERT_BENCH_URL"
ENV_ENDPOINT = "TILERT_BENCH_ENDPOINT"
ENV_MODEL = "TILERT_BENCH_MODEL"
ENV_TOKENIZER = "TILERT_BENCH_TOKENIZER"
ENV_METRICS = "TILERT_BENCH_METRICS_URLS"
ENV_RESULTS = "TILERT_BENCH_RESULTS_DIR"
ENV_JOB = "TILERT_BENCH_JOB_DIR"
ENV_GPUS = "TILERT_BENCH_GPUS"
SRTCTL_HOST = "SRT_FRONTEND_HOST"
SRTCTL_PORT = "SRT_FRONTEND_PORT"
SRTCTL_METRICS = "AIPERF_SERVER_METRICS_URLS"
CLIENT_ENV_NAMES = (
    ENV_URL,
    ENV_ENDPOINT,
    ENV_MODEL,
    ENV_TOKENIZER,
    ENV_METRICS,
    ENV_RESULTS,
    ENV_JOB,
    ENV_GPUS,
    SRTCTL_HOST,
    SRTCTL_PORT,
    SRTCTL_METRICS,
)


def client_env(target: BenchTarget, results: Path, base: Mapping[str, str]) -> dict[str, str]:
    """A custom command's environment: ``base`` (the job's) plus the target's facts."""
    split = urlsplit(target.router_url)
    metrics = ",".join(target.metrics_urls)
    env = dict(base)
    env.update(
        {
            ENV_URL: target.router_url,
            ENV_ENDPOINT: target.endpoint,
            ENV_MODEL: target.model,
            ENV_TOKENIZER: target.tokenizer or "",
            ENV_METRICS: metrics,
            ENV_RESULTS: str(results),
            ENV_JOB: str(target.job_dir),
            ENV_GPUS: str(target.gpus),
            SRTCTL_HOST: split.hostname or "",
            SRTCTL_PORT: str(split.port or (443 if split.scheme == "https" else 80)),
        }
    )
    # srtctl leaves a value the recipe set alone ("a curated endpoint list is never clobbered").
    env.setdefault(SRTCTL_METRICS, metrics)
    return env
