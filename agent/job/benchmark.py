"""The benchmark's formats and files in the job directory (docs/benchmark.md).

- ``BenchmarkPlan``: the ``benchmark`` part of ``J/plan.json`` (absent for ``type: manual``, so
  the plans of jobs without a benchmark read as before);
- ``BenchmarkStatus``: the ``benchmark`` block of ``J/status.json`` while the head runs it;
- ``BenchmarkSummary`` and ``LevelResult``: ``J/benchmark/summary.json``, one object per level,
  the file ``tilert-submit bench --show`` and ``--compare`` read;
- ``BenchmarkFiles``: where the results, the table and the plots of one run are.

The head writes them on the compute node and ``tilert-submit`` reads them where it runs, so the
field names are a contract (docs/benchmark.md lists them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from agent.job.vocab import BenchmarkState, BenchmarkVerdict

SUMMARY_SCHEMA = 1

BenchmarkType = Literal["aiperf", "custom"]
Placement = Literal["head", "last_decode"]
# The client's endpoint: TileRT 0.1.6 serves streaming chat completions only.
CHAT_ENDPOINT = "/v1/chat/completions"
# The folder of the head's run under J/, and of its log under J/logs/.
BENCHMARK_DIR = "benchmark"


class BenchmarkPlan(msgspec.Struct, kw_only=True):
    """``benchmark:`` resolved: what the head runs once the job is ready."""

    type: BenchmarkType
    # After the benchmark: keep serving (true), or end the job (false, the default).
    keep_serving: bool
    # The client's image under pyxis (None: the client runs on the node itself).
    image: str | None
    placement: Placement
    # Non-secret environment (recipe ``environment`` + ``benchmark.env``) and secret names.
    env: dict[str, str]
    secret_env: list[str]
    stop_grace_s: float
    # aiperf: the executable (``aiperf_command``) and the measurement.
    program: list[str] = []
    isl: int | None = None
    osl: int | None = None
    concurrencies: list[int] = []
    # Requests per second (None: as fast as the concurrency allows, srtctl's "inf").
    req_rate: float | None = None
    # Per level: a request count, or a duration.
    num_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    tokenizer: str | None = None
    extra_args: list[str] = []
    max_error_rate: float = 0.0
    # custom: the command, run with ``bash -c``.
    command: str | None = None


class BenchmarkStatus(msgspec.Struct, kw_only=True):
    """The ``benchmark`` block of ``status.json``."""

    state: BenchmarkState
    type: BenchmarkType
    # The concurrency being measured (running), or the one that failed.
    level: int | None = None
    levels_done: int = 0
    levels_total: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    # J/benchmark/summary.json once written.
    summary: str | None = None
    error: str | None = None
    keep_serving: bool = False


def pending_block(plan: BenchmarkPlan) -> BenchmarkStatus:
    """The status block of a benchmark that has not started (written at submit, and by the head)."""
    levels = len(plan.concurrencies) if plan.type == "aiperf" else 0
    return BenchmarkStatus(
        state="pending", type=plan.type, levels_total=levels, keep_serving=plan.keep_serving
    )


class LevelResult(msgspec.Struct, kw_only=True):
    """One concurrency level of a run: counts, throughput, latency percentiles, the verdict."""

    concurrency: int
    passed: bool
    error: str | None = None
    client_exit_code: int | None = None
    requests_ok: int = 0
    requests_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    duration_s: float | None = None
    request_throughput: float | None = None  # requests/s
    output_throughput: float | None = None  # output tokens/s, all users
    output_throughput_per_user: float | None = None  # output tokens/s seen by one user
    output_throughput_per_gpu: float | None = None  # output tokens/s per GPU (None: no GPU)
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p90_ms: float | None = None
    e2e_p99_ms: float | None = None
    # The client's own result folder for this level.
    results: str | None = None


class BenchmarkSummary(msgspec.Struct, kw_only=True):
    """``summary.json``: the verdict of one run and every level measured."""

    schema: int = SUMMARY_SCHEMA
    state: BenchmarkVerdict
    error: str | None = None
    type: BenchmarkType
    model: str
    router_url: str
    isl: int | None = None
    osl: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    req_rate: float | None = None
    max_error_rate: float = 0.0
    gpus: int = 0
    client_exit_code: int | None = None
    started_at: float = msgspec.field(default_factory=time.time)
    ended_at: float = msgspec.field(default_factory=time.time)
    levels: list[LevelResult] = []
    # PNG files next to summary.json; a note when none could be made.
    plots: list[str] = []
    plots_note: str | None = None


@dataclass(frozen=True)
class BenchmarkFiles:
    """The files of one benchmark run under ``root`` (``J/benchmark`` or ``J/benchmark/<time>``)."""

    root: Path

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def table(self) -> Path:
        return self.root / "summary.txt"

    def level_dir(self, concurrency: int) -> Path:
        """The client's result folder of one level."""
        return self.root / f"concurrency-{concurrency}"

    def plot(self, name: str) -> Path:
        """A PNG next to summary.json."""
        return self.root / f"{name}.png"


def head_run(job_root: Path) -> BenchmarkFiles:
    """The files of the benchmark the head runs: ``J/benchmark``."""
    return BenchmarkFiles(job_root / BENCHMARK_DIR)


def read_summary(path: Path) -> BenchmarkSummary:
    """Decode a ``summary.json`` (OSError, msgspec errors when unreadable)."""
    return msgspec.json.decode(path.read_bytes(), type=BenchmarkSummary)
