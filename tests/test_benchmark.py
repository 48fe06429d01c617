"""The benchmark without a real job: recipe keys and rules, the plan, sweeps and ``--unset``,
AIPerf's command line, results, the verdict, the summary and plots, the status line, and the
runner driving a stand-in client through the process launcher (docs/benchmark.md).

The real AIPerf through the real router is tests/test_benchmark_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import yaml

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE, aiperf_argv, level_requests
from agent.benchmark.plots import Series, make_plots
from agent.benchmark.results import read_level, read_records
from agent.benchmark.runner import BenchmarkRun
from agent.benchmark.summary import render_summary
from agent.benchmark.target import BenchTarget, client_env
from agent.benchmark.verdict import level_failure
from agent.job.benchmark import BenchmarkFiles, BenchmarkPlan, LevelResult, read_summary
from agent.launch import LaunchSpec, ProcessLauncher
from agent.problems import InputError
from agent.recipe.loader import load_recipe, load_recipe_text, recipe_sweep
from agent.recipe.planner import make_plan
from submit.bench import differences
from submit.cli import main as submit_main
from submit.statusview import benchmark_line
from tests.kit import DEMO_RECIPE, REPO

PNG = b"\x89PNG\r\n\x1a\n"
AIPERF = {"type": "aiperf", "isl": 64, "osl": 16, "concurrencies": [1, 4], "num_requests": 6}


def demo(**benchmark: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DEMO_RECIPE.read_text())
    data["benchmark"] = benchmark
    return data


def load(data: dict[str, Any]) -> Any:
    text = yaml.safe_dump(data, sort_keys=False)
    return load_recipe_text(text, source="t.yaml", base_dir=DEMO_RECIPE.parent)


def errors(data: dict[str, Any]) -> tuple[set[str], str]:
    """The key paths of the errors, and the whole report (messages and hints)."""
    with pytest.raises(InputError) as info:
        load(data)
    return {p.path for p in info.value.problems if p.severity == "error"}, str(info.value)


# ---- recipe keys, rules, plan ---------------------------------------------------------------


def test_aiperf_recipe_plans_with_its_defaults() -> None:
    plan = make_plan(load(demo(**{**AIPERF, "concurrencies": "1x4x16"})), mock=True)
    bench = plan.benchmark
    assert isinstance(bench, BenchmarkPlan)
    assert bench.concurrencies == [1, 4, 16]
    assert bench.program == ["aiperf"]
    assert bench.keep_serving is False
    assert bench.placement == "head"
    assert bench.max_error_rate == 0.0
    assert bench.req_rate is None
    # The tokenizer defaults to the router's model path, resolved like it.
    assert bench.tokenizer == str(REPO / "recipes" / "local-demo-model")


def test_manual_leaves_the_plan_as_it_was() -> None:
    plan = make_plan(load(demo(type="manual")), mock=True)
    assert "benchmark" not in msgspec.to_builtins(plan)


@pytest.mark.parametrize(
    ("benchmark", "path", "words"),
    [
        ({"type": "sa-bench"}, "benchmark.type", "/v1/completions"),
        ({"type": "gpqa"}, "benchmark.type", "/v1/models"),
        ({**AIPERF, "isl": None}, "benchmark.isl", "needs it"),
        ({**AIPERF, "osl": 0}, "benchmark.osl", "out of range"),
        ({**AIPERF, "concurrencies": [1, 0]}, "benchmark.concurrencies[1]", "out of range"),
        ({**AIPERF, "concurrencies": "1x0"}, "benchmark.concurrencies[1]", "not a level"),
        ({**AIPERF, "concurrencies": []}, "benchmark.concurrencies", "at least one"),
        ({**AIPERF, "concurrencies": "1x4x"}, "benchmark.concurrencies", "list of levels"),
        ({**AIPERF, "duration_s": 30}, "benchmark.duration_s", "both set"),
        ({**AIPERF, "max_error_rate": 2}, "benchmark.max_error_rate", "from 0 to 1"),
        ({**AIPERF, "req_rate": "fast"}, "benchmark.req_rate", "not a rate"),
        ({**AIPERF, "warmup_requests": -1}, "benchmark.warmup_requests", "out of range"),
        ({**AIPERF, "extra_args": ["--url=x"]}, "benchmark.extra_args[0]", "set by the agent"),
        ({**AIPERF, "command": "x"}, "benchmark.command", "not used by benchmark type aiperf"),
        ({**AIPERF, "client_placement": "frontend"}, "benchmark.client_placement", "unknown"),
        ({"type": "custom"}, "benchmark.command", "needs a command"),
        ({"type": "custom", "command": "x", "isl": 4}, "benchmark.isl", "type custom reads"),
        ({"type": "manual", "keep_serving": False}, "benchmark.keep_serving", "serves until"),
        ({**AIPERF, "concurency": [1]}, "benchmark.concurency", "unknown key"),
        ({**AIPERF, "aiperf_args": ["-v"]}, "benchmark.aiperf_args", "extra_args"),
        ({**AIPERF, "isl": "64"}, "benchmark.isl", "expected an integer"),
    ],
)
def test_benchmark_rules_name_the_key(benchmark: dict[str, Any], path: str, words: str) -> None:
    paths, report = errors(demo(**{k: v for k, v in benchmark.items() if v is not None}))
    assert path in paths, report
    assert words in report, report


def test_tokenizer_must_be_named() -> None:
    data = demo(**AIPERF)
    del data["frontend"]["args"]["model-path"]
    assert "benchmark.tokenizer" in errors(data)[0]


# ---- sweeps and --unset ---------------------------------------------------------------------

SWEEP = """\
{recipe}
benchmark: {{type: aiperf, isl: 64, osl: 16, concurrencies: ["{{conc}}"], num_requests: 4}}
sweep: {{conc: [1, 4], seq: [4096, {bad}]}}
"""


def sweep_recipe(tmp_path: Path, bad: str = "8192") -> Path:
    base = DEMO_RECIPE.read_text().replace("benchmark: {type: manual}\n", "")
    for key in ("max-model-len", "tilert_max_seq_len", "max-seq-len"):
        base = base.replace(f"{key}: 4096", f'{key}: "{{seq}}"')
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.format(recipe=base, bad=bad))
    (tmp_path / "local-demo-model").symlink_to(DEMO_RECIPE.parent / "local-demo-model")
    return path


def test_sweep_is_a_cartesian_product_named_after_its_values(tmp_path: Path) -> None:
    path = sweep_recipe(tmp_path)
    combos = recipe_sweep(path)
    assert combos is not None
    assert [c.label() for c in combos] == [
        "conc=1, seq=4096",
        "conc=1, seq=8192",
        "conc=4, seq=4096",
        "conc=4, seq=8192",
    ]
    loaded = load_recipe(path, combination=combos[3])
    recipe = loaded.recipe
    assert recipe.name == "local-demo-conc4-seq8192"
    assert recipe.benchmark.concurrencies == [4]  # an exact placeholder keeps the value's type
    assert recipe.roles.decode is not None
    assert recipe.roles.decode.args["max-seq-len"] == 8192
    assert recipe.roles.prefill is not None
    assert recipe.roles.prefill.args["max-model-len"] == 8192
    with pytest.raises(InputError, match="this recipe is a sweep"):
        load_recipe(path)


def test_sweep_dry_run_shows_every_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = sweep_recipe(tmp_path)
    assert submit_main([str(path), "--mock", "--dry-run", "--job-dir", str(tmp_path / "j")]) == 0
    out = capsys.readouterr().out
    assert out.count("Job directory:") == 4
    assert "sweep: 4 jobs" in out
    assert "local-demo-conc1-seq4096" in out
    assert "Benchmark (once ready" in out
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "local-demo-conc1-seq4096",
        "local-demo-conc1-seq8192",
        "local-demo-conc4-seq4096",
        "local-demo-conc4-seq8192",
    ]


def test_one_bad_combination_submits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A negative sequence limit: the combinations with it do not validate, the others do.
    path = sweep_recipe(tmp_path, bad="-3")
    assert submit_main([str(path), "--mock", "--job-dir", str(tmp_path / "j")]) == 2
    err = capsys.readouterr().err
    assert "sweep combination conc=1, seq=-3" in err
    assert "sweep combination conc=4, seq=-3" in err
    assert "conc=1, seq=4096:" not in err
    assert "2 of 4 sweep combinations" in err
    assert "nothing was submitted" in err
    assert not (tmp_path / "j").exists()


def test_sweep_refuses_local_and_checks_unused_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sweep_recipe(tmp_path)
    assert submit_main([str(path), "--mock", "--local"]) == 2
    assert "sweep of 4" in capsys.readouterr().err
    path.write_text(path.read_text().replace("seq: [4096, 8192]", "seq: [4096, 8192], x: [1]"))
    with pytest.raises(InputError, match=r"sweep\.x"):
        recipe_sweep(path)


def test_unset_removes_a_key_and_refuses_a_missing_one() -> None:
    text = DEMO_RECIPE.read_text()
    loaded = load_recipe_text(
        text, source="d", base_dir=DEMO_RECIPE.parent, unsets=["frontend.args.queue-timeout"]
    )
    assert "queue-timeout" not in loaded.recipe.frontend.args
    with pytest.raises(InputError, match=r"--unset environment\.NOPE"):
        load_recipe_text(text, source="d", base_dir=DEMO_RECIPE.parent, unsets=["environment.NOPE"])


# ---- AIPerf's command line, results, verdict -------------------------------------------------


def target(tmp_path: Path, gpus: int = 16) -> BenchTarget:
    return BenchTarget(
        router_url="http://10.0.0.1:8000",
        model="glm5",
        tokenizer="/models/glm5",
        metrics_urls=("http://10.0.0.1:9100/metrics", "http://10.0.0.2:9200/metrics"),
        gpus=gpus,
        job_dir=tmp_path,
    )


def aiperf_plan(**changes: Any) -> BenchmarkPlan:
    fields: dict[str, Any] = {
        "type": "aiperf",
        "keep_serving": False,
        "image": None,
        "placement": "head",
        "env": {},
        "secret_env": [],
        "stop_grace_s": 2.0,
        "program": ["aiperf"],
        "isl": 64,
        "osl": 16,
        "concurrencies": [1, 4],
        "num_requests": 6,
    }
    fields.update(changes)
    return BenchmarkPlan(**fields)


def test_aiperf_gets_the_router_model_endpoint_tokenizer_and_every_metrics_url(
    tmp_path: Path,
) -> None:
    argv = aiperf_argv(aiperf_plan(extra_args=["--foo"]), target(tmp_path), 4, tmp_path / "c4")
    pairs = dict(itertools.pairwise(argv))
    assert argv[:2] == ["aiperf", "profile"]
    assert argv[-1] == "--foo"
    assert pairs["--url"] == "http://10.0.0.1:8000"
    assert pairs["--model"] == "glm5"
    assert pairs["--endpoint-type"] == "chat"
    assert pairs["--endpoint"] == "/v1/chat/completions"
    assert "--streaming" in argv
    assert pairs["--tokenizer"] == "/models/glm5"
    assert pairs["--concurrency"] == "4"
    assert pairs["--request-count"] == "6"
    assert pairs["--extra-inputs"] == "ignore_eos:true"
    assert "--use-server-token-count" in argv
    i = argv.index("--server-metrics")
    assert argv[i + 1 : i + 3] == list(target(tmp_path).metrics_urls)
    timed = aiperf_argv(
        aiperf_plan(num_requests=None, duration_s=60), target(tmp_path), 4, tmp_path
    )
    assert "--request-count" not in timed
    assert "--benchmark-duration" in timed
    assert level_requests(aiperf_plan(num_requests=None), 8) == 80


EXPORT = {
    "request_count": {"avg": 6.0},
    "completed_request_count": {"avg": 8.0},
    "error_request_count": {"avg": 2.0},
    "total_isl": {"avg": 384.0},
    "total_osl": {"avg": 96.0},
    "benchmark_duration": {"avg": 2.0},
    "request_throughput": {"avg": 3.0},
    "output_token_throughput": {"avg": 48.0},
    "output_token_throughput_per_user": {"avg": 20.0},
    "time_to_first_token": {"p50": 10.0, "p90": 20.0, "p99": 30.0},
    "inter_token_latency": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
    "request_latency": {"p50": 100.0, "p90": 200.0, "p99": 300.0},
    "error_summary": [{"error_details": {"code": 503, "message": "busy"}, "count": 2}],
    "input_config": {"phases": [{"kind": "profiling", "concurrency": 4}]},
}


def test_results_are_read_with_the_documented_names(tmp_path: Path) -> None:
    (tmp_path / EXPORT_FILE).write_text(json.dumps(EXPORT))
    fields, error = read_level(tmp_path, gpus=16)
    assert fields["concurrency"] == 4
    assert fields["requests_ok"] == 6
    assert fields["requests_failed"] == 2
    assert fields["output_tokens"] == 96
    assert fields["output_throughput_per_gpu"] == 3.0
    assert fields["ttft_p99_ms"] == 30.0
    assert fields["itl_p50_ms"] == 1.0
    assert fields["e2e_p90_ms"] == 200.0
    assert error == "busy (HTTP 503) x2"
    (tmp_path / RECORDS_FILE).write_text(
        '{"error": {"message": "empty"}}\n{"metrics": {"output_sequence_length": {"value": 5}}}\n'
    )
    assert read_records(tmp_path) == (1, 1, 5, "empty x1")


def verdict(**changes: Any) -> str | None:
    fields: dict[str, Any] = {
        "concurrency": 4,
        "exit_code": 0,
        "requests_ok": 6,
        "requests_failed": 0,
        "output_tokens": 96,
        "requested": 6,
        "max_error_rate": 0.0,
        "results_error": None,
        "request_error": None,
        "client_said": None,
    }
    fields.update(changes)
    return level_failure(**fields)


def test_verdict_never_passes_silently() -> None:
    assert verdict() is None
    assert verdict(output_tokens=0) == "concurrency 4: 0 output tokens in 6 request(s)"
    zero = verdict(
        output_tokens=0, requests_ok=0, requests_failed=6, exit_code=1, request_error="x"
    )
    assert (
        zero == "concurrency 4: 0 output tokens in 6 request(s): 6 failed (x); "
        "the client exited with status 1"
    )
    assert "1 of 6 requests failed (17%), more than max_error_rate 0" in str(
        verdict(requests_ok=5, requests_failed=1)
    )
    assert verdict(requests_ok=5, requests_failed=1, max_error_rate=0.2) is None
    assert "exited with status 2: boom" in str(verdict(exit_code=2, client_said="boom"))
    assert verdict(requests_ok=4) == "concurrency 4: only 4 of 6 requests completed"


# ---- summary, plots, status line, labels ----------------------------------------------------


def level(concurrency: int, tps: float, **changes: Any) -> LevelResult:
    fields: dict[str, Any] = {
        "concurrency": concurrency,
        "passed": True,
        "requests_ok": 6,
        "output_tokens": 96,
        "output_throughput": tps,
        "output_throughput_per_user": tps / concurrency,
        "output_throughput_per_gpu": tps / 16,
        "ttft_p50_ms": 10.0 * concurrency,
        "ttft_p90_ms": 12.0 * concurrency,
        "ttft_p99_ms": 15.0 * concurrency,
        "itl_p50_ms": 2.0,
        "itl_p90_ms": 3.0,
        "itl_p99_ms": 4.0,
    }
    fields.update(changes)
    return LevelResult(**fields)


def test_plots_are_pngs_with_one_curve_per_series(tmp_path: Path) -> None:
    series = [Series("a", [level(1, 50.0), level(4, 150.0)]), Series("b", [level(1, 40.0)])]
    written = make_plots(series, tmp_path, "t")
    assert [p.name for p in written] == ["output_throughput.png", "latency.png", "pareto.png"]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG)
        assert data[12:16] == b"IHDR"
        assert len(data) > 2000


def test_status_line_says_which_level_and_why() -> None:
    from agent.job.benchmark import BenchmarkStatus

    running = BenchmarkStatus(
        state="running", type="aiperf", level=4, levels_done=1, levels_total=3
    )
    assert benchmark_line(running) == "benchmark: running: concurrency 4 (level 2 of 3)"
    failed = BenchmarkStatus(
        state="failed", type="aiperf", level=4, error="concurrency 4: 0 output tokens", summary="S"
    )
    assert (
        benchmark_line(failed) == "benchmark: failed: concurrency 4: 0 output tokens (summary: S)"
    )


def test_compare_labels_name_what_differs() -> None:
    facts = [
        {"name": "a", "agent.router_port": "1", "roles.decode.args.max-seq-len": "4096"},
        {"name": "b", "agent.router_port": "2", "roles.decode.args.max-seq-len": "8192"},
    ]
    assert differences(facts) == ["max-seq-len=4096", "max-seq-len=8192"]
    assert differences([{"name": "a"}, {"name": "b"}]) == ["", ""]


def test_custom_command_environment(tmp_path: Path) -> None:
    env = client_env(target(tmp_path), tmp_path / "r", {"AIPERF_SERVER_METRICS_URLS": "mine"})
    assert env["SRT_FRONTEND_HOST"] == "10.0.0.1"
    assert env["SRT_FRONTEND_PORT"] == "8000"
    assert env["TILERT_BENCH_URL"] == "http://10.0.0.1:8000"
    assert env["TILERT_BENCH_MODEL"] == "glm5"
    assert env["TILERT_BENCH_METRICS_URLS"].count("/metrics") == 2
    assert env["AIPERF_SERVER_METRICS_URLS"] == "mine"  # a value the recipe set wins, as in srtctl


# ---- the runner, with a stand-in client --------------------------------------------------------

# A stand-in for aiperf: writes an export for the level it is asked for; no output token at the
# concurrency named by $FAKE_ZERO_AT.
FAKE_AIPERF = f"""\
import json, os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("0.13.0"); sys.exit(0)
conc = int(args[args.index("--concurrency") + 1])
n = int(args[args.index("--request-count") + 1])
out = args[args.index("--artifact-dir") + 1]
export = json.loads({json.dumps(json.dumps(EXPORT))})
export["request_count"] = {{"avg": n}}
export["completed_request_count"] = {{"avg": n}}
del export["error_request_count"], export["error_summary"]
export["input_config"]["phases"][0]["concurrency"] = conc
if os.environ.get("FAKE_ZERO_AT") == str(conc):
    export["total_osl"] = {{"avg": 0}}
open(os.path.join(out, "{EXPORT_FILE}"), "w").write(json.dumps(export))
print("level", conc, "done", flush=True)
"""


def make_run(
    tmp_path: Path, plan: BenchmarkPlan, env: dict[str, str] | None = None
) -> BenchmarkRun:
    def build(name: str, argv: list[str], env: dict[str, str], _image: str | None) -> LaunchSpec:
        return LaunchSpec(name=name, argv=argv, env=env)

    return BenchmarkRun(
        plan,
        target(tmp_path),
        BenchmarkFiles(tmp_path / "benchmark"),
        launcher=ProcessLauncher(),
        launch_spec=build,
        env={**os.environ, **(env or {})},
        log_path=tmp_path / "logs" / "benchmark.log",
        log_max_bytes=1 << 20,
        log_backups=1,
        log=logging.getLogger("test"),
    )


@pytest.fixture
def fake_aiperf(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_aiperf.py"
    script.write_text(FAKE_AIPERF)
    return [sys.executable, str(script)]


async def test_levels_run_in_order_and_the_first_failure_ends_the_run(
    tmp_path: Path, fake_aiperf: list[str]
) -> None:
    plan = aiperf_plan(program=fake_aiperf, concurrencies=[1, 4, 16])
    run = make_run(tmp_path, plan, {"FAKE_ZERO_AT": "4"})
    assert await run.preflight() is None
    summary = await run.run()
    assert summary.state == "failed"
    assert summary.error == "concurrency 4: 0 output tokens in 6 request(s)"
    assert [(lv.concurrency, lv.passed) for lv in summary.levels] == [(1, True), (4, False)]
    status = run.status()
    assert status.state == "failed"
    assert status.level == 4
    assert status.levels_done == 1
    on_disk = read_summary(tmp_path / "benchmark" / "summary.json")
    assert on_disk.error == summary.error
    assert on_disk.plots == summary.plots
    assert "level 1 done" in (tmp_path / "logs" / "benchmark.log").read_text()
    assert "FAILED" in render_summary(on_disk)


async def test_a_passing_run_and_a_client_that_cannot_start(
    tmp_path: Path, fake_aiperf: list[str]
) -> None:
    summary = await make_run(tmp_path / "ok", aiperf_plan(program=fake_aiperf)).run()
    assert summary.state == "passed"
    assert len(summary.levels) == 2
    assert summary.levels[1].output_tokens == 96
    assert summary.levels[1].output_throughput_per_gpu
    missing = make_run(tmp_path / "no", aiperf_plan(program=[str(tmp_path / "nope")]))
    problem = await missing.preflight()
    assert problem is not None
    assert "cannot run the benchmark client" in problem


async def test_custom_command_sees_its_environment_and_its_exit_status_counts(
    tmp_path: Path,
) -> None:
    command = 'env | grep -E "^(TILERT_BENCH|SRT_FRONTEND)" > "$TILERT_BENCH_RESULTS_DIR/env.txt"'
    plan = aiperf_plan(type="custom", command=command, concurrencies=[])
    summary = await make_run(tmp_path, plan).run()
    assert summary.state == "passed"
    assert summary.client_exit_code == 0
    seen = (tmp_path / "benchmark" / "env.txt").read_text()
    assert "SRT_FRONTEND_PORT=8000" in seen
    assert "TILERT_BENCH_MODEL=glm5" in seen
    failing = aiperf_plan(type="custom", command="echo nope >&2; exit 3", concurrencies=[])
    summary = await make_run(tmp_path / "f", failing).run()
    assert summary.state == "failed"
    assert summary.error == "the custom command exited with status 3: nope"


async def test_stop_ends_a_run_at_once(tmp_path: Path) -> None:
    plan = aiperf_plan(type="custom", command="echo started; exec sleep 60", concurrencies=[])
    run = make_run(tmp_path, plan)
    log = tmp_path / "logs" / "benchmark.log"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run.run)
        with trio.fail_after(10):
            while not (log.exists() and "started" in log.read_text(errors="replace")):  # noqa: ASYNC110 (a file, not an event)
                await trio.sleep(0.05)
        run.stop("stopped on request")
        with trio.fail_after(10):
            await run.done.wait()
    assert run.summary is not None
    assert run.summary.state == "failed"
    assert run.summary.error == "stopped on request"
    assert "stopped on request: exit status -15" in log.read_text()  # SIGTERM, and it ended


def test_bench_command_refuses_what_it_cannot_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "j"
    assert submit_main([str(DEMO_RECIPE), "--mock", "--dry-run", "--job-dir", str(job)]) == 0
    capsys.readouterr()
    assert submit_main(["bench", str(job), "--isl", "8", "--osl", "8"]) == 1
    assert "the job is pending, not ready" in capsys.readouterr().err
    assert submit_main(["bench", str(job), "--show"]) == 1
    assert "no benchmark results" in capsys.readouterr().err
    assert submit_main(["bench"]) == 2
    assert submit_main(["bench", str(tmp_path / "nope")]) == 2


async def test_a_job_directory_that_refuses_writes_fails_the_run_not_the_agent(
    tmp_path: Path, fake_aiperf: list[str]
) -> None:
    (tmp_path / "benchmark").write_text("a file where the results folder goes")
    run = make_run(tmp_path, aiperf_plan(program=fake_aiperf))
    summary = await run.run()
    assert summary.state == "failed"
    assert summary.error is not None
    assert summary.error.startswith(f"cannot make {tmp_path / 'benchmark'}")
    assert run.status().state == "failed"
    assert run.status().summary is None  # summary.json could not be written either
