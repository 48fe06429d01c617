"""The benchmark stage end to end: ``tilert-submit --local --mock`` with the REAL TileRT router and
the REAL AIPerf (docs/benchmark.md).

One job with ``keep_serving: true`` is shared, in file order: its two levels pass with the counts
that were sent, its plots are PNGs, it keeps serving, ``tilert-submit bench`` measures it again,
then it is stopped. The others each run a job of their own: a decode stand-in that answers with
no token fails the benchmark and the job; a custom command sees its environment and, with
``keep_serving: false``, the job ends ``stopped``; a stop during a benchmark ends it cleanly.
Few and small: AIPerf itself takes seconds to start on 2 shared cores.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests import kit

pytestmark = pytest.mark.router

READY_S = 120.0  # a bound only: a router start takes 20 s on a loaded 2-core machine
# Two AIPerf levels of a handful of requests: ~30 s each on 2 loaded cores, more when shared.
BENCH_S = 300.0
ISL, OSL, REQUESTS = 64, 16, 6
PNG = b"\x89PNG\r\n\x1a\n"


def aiperf_sets(aiperf: Path, *extra: str, levels: str = "[1, 4]", keep: bool = False) -> list[str]:
    """The demo plus an aiperf benchmark, the decodes slowed to ~5 ms per token."""
    bench = (
        f"{{type: aiperf, isl: {ISL}, osl: {OSL}, concurrencies: {levels}, "
        f"num_requests: {REQUESTS}, aiperf_command: {aiperf}, keep_serving: {str(keep).lower()}}}"
    )
    return [f"benchmark={bench}", "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.005", *extra]


def bench_state(job: Path, states: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """status.json once its benchmark block is in one of ``states``."""
    return kit.wait_status(
        job,
        lambda s: (s.get("benchmark") or {}).get("state") in states,
        f"with the benchmark in {states}",
        timeout,
    )


def summary(root: Path) -> dict[str, Any]:
    """A run's summary.json."""
    data: dict[str, Any] = json.loads((root / "summary.json").read_text())
    return data


def check_counts(
    levels: list[dict[str, Any]], concurrencies: list[int], requests: int, isl: int, osl: int
) -> None:
    """Every level passed with exactly the requests sent and ``osl`` output tokens each."""
    assert [lv["concurrency"] for lv in levels] == concurrencies, levels
    for lv in levels:
        assert lv["passed"], lv
        assert lv["error"] is None, lv
        assert lv["requests_ok"] == requests, lv
        assert lv["requests_failed"] == 0, lv
        # ignore_eos through the real router: the decode stand-in streams exactly osl tokens.
        assert lv["output_tokens"] == requests * osl, lv
        # The server counts the prompt with its chat template around it.
        assert lv["input_tokens"] >= requests * isl, lv
        assert lv["output_throughput"] > 0, lv
        assert lv["request_throughput"] > 0, lv
        for name in ("ttft", "itl", "e2e"):
            assert lv[f"{name}_p50_ms"] > 0, lv
            assert lv[f"{name}_p99_ms"] >= lv[f"{name}_p50_ms"], lv


@pytest.fixture(scope="module")
def shared_served(
    router_python: Path, aiperf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[kit.Shared[kit.LocalJob]]:
    """The demo with a two-level benchmark and keep_serving true, shared by this module's tests."""

    def start() -> kit.LocalJob:
        sets, _ = kit.isolated_sets(router_python, *aiperf_sets(aiperf, keep=True))
        return kit.LocalJob(tmp_path_factory.mktemp("bench-e2e") / "job", sets)

    def prepare(job: kit.LocalJob) -> None:
        job.wait_state("ready", timeout=READY_S)
        bench_state(job.job, ("passed", "failed"), BENCH_S)

    with kit.Shared(start, prepare=prepare, ended=kit.LocalJob.ended) as shared:
        yield shared


@pytest.fixture
def served(
    shared_served: kit.Shared[kit.LocalJob], request: pytest.FixtureRequest
) -> Iterator[kit.LocalJob]:
    """The shared job, ready, its benchmark done."""
    yield from shared_served.borrow(request)


@pytest.fixture
def served_to_stop(shared_served: kit.Shared[kit.LocalJob]) -> Iterator[kit.LocalJob]:
    """The shared job for a test that stops it."""
    yield from shared_served.consume()


@pytest.mark.aiperf
def test_two_levels_pass_with_the_counts_sent(served: kit.LocalJob) -> None:
    status = served.status()
    bench = status["benchmark"]
    assert bench["state"] == "passed", bench
    assert bench["levels_done"] == bench["levels_total"] == 2
    assert bench["error"] is None
    result = summary(served.job / "benchmark")
    assert result["state"] == "passed"
    assert result["error"] is None
    assert result["model"] == kit.MODEL
    assert result["router_url"] == status["router_url"]
    check_counts(result["levels"], [1, 4], REQUESTS, ISL, OSL)
    for level in (1, 4):  # one result folder per level, AIPerf's own files in it
        assert (
            served.job / "benchmark" / f"concurrency-{level}" / "profile_export_aiperf.json"
        ).is_file()
    assert "TTFT p50" in (served.job / "benchmark" / "summary.txt").read_text()


@pytest.mark.aiperf
def test_plots_are_valid_pngs(served: kit.LocalJob) -> None:
    result = summary(served.job / "benchmark")
    assert result["plots"] == ["output_throughput.png", "latency.png", "pareto.png"], result
    for name in result["plots"]:
        data = (served.job / "benchmark" / name).read_bytes()
        assert data.startswith(PNG), name
        assert data[12:16] == b"IHDR", name


@pytest.mark.aiperf
def test_keep_serving_leaves_the_job_ready(served: kit.LocalJob) -> None:
    status = served.wait_state("ready", timeout=10)
    assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
    done = kit.submit_cmd("status", str(served.job))
    assert done.returncode == 0, done.stdout
    assert "job: ready" in done.stdout, done.stdout
    assert "benchmark: passed: 2 of 2 levels" in done.stdout, done.stdout
    logs = kit.submit_cmd("logs", str(served.job), "benchmark")
    assert logs.returncode == 0, logs.stderr
    assert "=== concurrency 4: pid" in logs.stdout, logs.stderr


@pytest.mark.aiperf
def test_bench_command_on_the_ready_job(served: kit.LocalJob, aiperf: Path) -> None:
    args = ["--concurrencies", "2", "--isl", "32", "--osl", "8", "--num-requests", "4"]
    done = kit.submit_cmd(
        "bench", str(served.job), *args, "--aiperf-command", str(aiperf), timeout=BENCH_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [p for p in (served.job / "benchmark").iterdir() if (p / "summary.json").is_file()]
    assert runs, "no J/benchmark/<time>/ beside the head's own results"
    result = summary(max(runs))
    assert result["state"] == "passed"
    assert result["isl"] == 32
    check_counts(result["levels"], [2], 4, 32, 8)
    shown = kit.submit_cmd("bench", str(served.job), "--show")
    assert shown.returncode == 0, shown.stdout
    assert f"results: {max(runs)}" in shown.stdout, shown.stdout
    assert served.status()["state"] == "ready"  # measured without being touched


@pytest.mark.aiperf
def test_stop_after_the_benchmark(served_to_stop: kit.LocalJob) -> None:
    job = served_to_stop
    done = kit.submit_cmd("stop", str(job.job), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert job.wait_exit(30) == 0, job.output()
    kit.assert_nothing_left(job.job, 10)
    assert kit.current_status(job.job)["state"] == "stopped"


@pytest.mark.aiperf
def test_a_decode_answering_no_token_fails_the_benchmark_and_the_job(
    router_python: Path, aiperf: Path, tmp_path: Path
) -> None:
    # Each decode answers its canary, then streams no token at all.
    fault = "roles.decode.env.TILERT_MOCK_NO_TOKENS_AFTER_REQUESTS=1"
    sets, _ = kit.isolated_sets(router_python, *aiperf_sets(aiperf, fault, levels="[2, 4]"))
    with kit.LocalJob(tmp_path / "job", sets) as job:
        assert job.wait_exit(READY_S + BENCH_S) == 1, job.output()
        status = job.status()
        assert status["state"] == "failed", status
        bench = status["benchmark"]
        assert bench["state"] == "failed", bench
        assert bench["level"] == 2, bench
        assert bench["error"].startswith("concurrency 2: 0 output tokens in 6 request(s)"), bench
        assert status["error"] == f"benchmark failed: {bench['error']}"
        result = summary(tmp_path / "job" / "benchmark")
        assert result["state"] == "failed"
        assert [lv["concurrency"] for lv in result["levels"]] == [2]
        shown = kit.submit_cmd("status", str(tmp_path / "job"))
        assert "benchmark: failed: concurrency 2: 0 output tokens" in shown.stdout, shown.stdout
        kit.assert_nothing_left(job.job, 10)


CUSTOM = (
    'env | grep -E "^(TILERT_BENCH_|SRT_FRONTEND_|AIPERF_SERVER|MY_SETTING)" | sort '
    '> "$TILERT_BENCH_RESULTS_DIR/env.txt"'
)


def test_custom_command_sees_its_environment_and_the_job_ends_stopped(
    router_python: Path, tmp_path: Path
) -> None:
    bench = f"benchmark={{type: custom, command: '{CUSTOM}', env: {{MY_SETTING: x1}}}}"
    sets, port = kit.isolated_sets(router_python, bench)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        assert job.wait_exit(READY_S + 30) == 0, job.output()
        status = job.status()
        assert status["state"] == "stopped", status
        assert status["error"] is None, status
        assert status["benchmark"]["state"] == "passed", status["benchmark"]
        # Ended by its benchmark: the final status shows no agent serving for good.
        for entry in [*status["agents"], status["router"]]:
            assert entry["state"] == "stopped", entry
        seen = dict(
            line.split("=", 1)
            for line in (tmp_path / "job" / "benchmark" / "env.txt").read_text().splitlines()
        )
        assert seen["TILERT_BENCH_URL"] == f"http://127.0.0.1:{port}"
        assert seen["SRT_FRONTEND_HOST"] == "127.0.0.1"
        assert seen["SRT_FRONTEND_PORT"] == str(port)
        assert seen["TILERT_BENCH_MODEL"] == kit.MODEL
        assert seen["MY_SETTING"] == "x1"
        assert seen["TILERT_BENCH_ENDPOINT"] == "/v1/chat/completions"
        assert len(seen["TILERT_BENCH_METRICS_URLS"].split(",")) == 3  # every agent's /metrics
        assert seen["AIPERF_SERVER_METRICS_URLS"] == seen["TILERT_BENCH_METRICS_URLS"]
        kit.assert_nothing_left(job.job, 10)


def test_a_stop_during_the_benchmark_ends_it_cleanly(router_python: Path, tmp_path: Path) -> None:
    sets, _ = kit.isolated_sets(
        router_python, "benchmark={type: custom, command: 'exec sleep 300'}"
    )
    with kit.LocalJob(tmp_path / "job", sets) as job:
        bench_state(job.job, ("running",), READY_S)
        log = tmp_path / "job" / "logs" / "benchmark" / "benchmark.log"
        kit.wait_status(job.job, lambda _: log.exists() and "pid" in log.read_text(), "", 10)
        pid = int(log.read_text().split("pid ", 1)[1].split(":", 1)[0])
        client = psutil.Process(pid)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()
        kit.assert_gone([client], 5)
        kit.assert_nothing_left(job.job, 10)
        status = job.status()
        assert status["state"] == "stopped", status
        bench = status["benchmark"]
        assert bench["state"] == "failed", bench
        assert bench["error"] == "stopped on request", bench


# A custom client that leaves a malformed AIPerf export (error_details a string, a count a
# string) and a level with 0 output tokens, says something full of control characters, and exits 1.
BAD_CLIENT = """\
import json, os
root = os.environ["TILERT_BENCH_RESULTS_DIR"]
for name, export in {
    "bad": {"error_summary": [{"error_details": "boom", "count": "2"}]},
    "zero": {"request_count": {"avg": 0}, "error_request_count": {"avg": 40},
             "total_osl": {"avg": 0},
             "input_config": {"phases": [{"kind": "profiling", "concurrency": 4}]}},
}.items():
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, "profile_export_aiperf.json"), "w") as f:
        json.dump(export, f)
print("ERROR \\x1b]0;pwned\\x07 \\x00\\r done", flush=True)
raise SystemExit(1)
"""


def test_a_custom_client_with_malformed_and_empty_results_fails_the_job_not_the_head(
    router_python: Path, tmp_path: Path
) -> None:
    script = tmp_path / "client.py"
    script.write_text(BAD_CLIENT)
    bench = f"benchmark={{type: custom, command: '{sys.executable} {script}'}}"
    sets, _ = kit.isolated_sets(router_python, bench)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        assert job.wait_exit(READY_S + 30) == 1, job.output()
        status = job.status()
        assert status["state"] == "failed", status  # the head said why: it did not crash
        bench_block = status["benchmark"]
        assert bench_block["state"] == "failed", bench_block
        # What it said, escaped (its terminal title escape shown, not acted on).
        assert "ERROR \\x1b]0;pwned\\x07 \\x00" in bench_block["error"], bench_block
        results = tmp_path / "job" / "benchmark"
        result = summary(results)  # the summary is written
        assert result["state"] == "failed"
        reasons = " | ".join(lv["error"] for lv in result["levels"])
        assert str(results / "bad" / "profile_export_aiperf.json") in reasons, reasons
        assert "0 output tokens in 40 request(s)" in reasons, reasons
        for entry in [*status["agents"], status["router"]]:
            assert entry["state"] == "stopped", entry
        shown = kit.submit_cmd("status", str(tmp_path / "job"))
        for text in (shown.stdout, job.output()):
            assert "\x1b" not in text
            assert "\x07" not in text
        # In status.json what the client said is escaped by us (\x1b), not by JSON (\u001b).
        raw = (tmp_path / "job" / "status.json").read_text()
        assert "\\u001b" not in raw
        assert "\\u0007" not in raw
        kit.assert_nothing_left(job.job, 10)
