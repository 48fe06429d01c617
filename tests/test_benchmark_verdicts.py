"""The benchmark under bad results and bad words (issue 19): every level is judged by what it
measured whoever ran the client, a malformed AIPerf export fails its level (never the head), and
what a client says reaches status.json, ``status``, ``bench --show`` and the local runner's lines
escaped. Real processes through the process launcher; the clients are small scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE
from agent.benchmark.results import ResultsError, read_level, read_records
from agent.benchmark.runner import NO_RESULTS_NOTE, judge_level
from agent.benchmark.summary import render_summary, write_summary
from agent.job.benchmark import BenchmarkFiles, BenchmarkSummary, read_summary
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.job.records import JobAgent, JobStatus, with_last_states
from agent.job.vocab import AgentState, Process
from submit.bench import add_arguments as bench_add_arguments
from submit.bench import bench_plan, new_run_folder
from submit.cli import main as submit_main
from submit.statusview import benchmark_line, render_table
from tests.kit import DEMO_RECIPE
from tests.test_benchmark import EXPORT, aiperf_plan, make_run

# Every character a terminal acts on: C0, DEL, C1 (ESC, BEL, NUL, CR among them).
CONTROL = "".join(chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)])


def has_control(text: str) -> bool:
    """Whether ``text`` holds a character a terminal would act on."""
    return any(c in CONTROL for c in text)


def client_writing(tmp_path: Path, folders: dict[str, Any], *, code: int = 0, say: str = "") -> str:
    """A custom command: a script that writes ``folders`` ({name: export dict, or raw text}) under
    $TILERT_BENCH_RESULTS_DIR, prints ``say`` and exits ``code``."""
    script = tmp_path / "client.py"
    script.write_text(
        "import json, os, sys\n"
        f"folders = json.loads({json.dumps(json.dumps(folders))})\n"
        "root = os.environ['TILERT_BENCH_RESULTS_DIR']\n"
        "for name, body in folders.items():\n"
        "    os.makedirs(os.path.join(root, name), exist_ok=True)\n"
        "    text = body if isinstance(body, str) else json.dumps(body)\n"
        f"    open(os.path.join(root, name, {EXPORT_FILE!r}), 'w').write(text)\n"
        f"sys.stdout.write({say!r} + '\\n')\n"
        f"sys.exit({code})\n"
    )
    return f"{sys.executable} {script}"


def passing(concurrency: int) -> dict[str, Any]:
    """An export of a level that passes: 8 requests, none failed, 96 output tokens."""
    export: dict[str, Any] = json.loads(json.dumps(EXPORT))
    del export["error_request_count"], export["error_summary"]
    export["request_count"] = {"avg": 8}
    export["input_config"]["phases"][0]["concurrency"] = concurrency
    return export


def zero_tokens(concurrency: int = 4) -> dict[str, Any]:
    """An export of a level whose every request failed: 0 ok, 40 failed, 0 output tokens."""
    export: dict[str, Any] = json.loads(json.dumps(EXPORT))
    export.update(
        request_count={"avg": 0},
        completed_request_count={"avg": 40},
        error_request_count={"avg": 40},
        total_osl={"avg": 0},
        error_summary=[{"error_details": {"message": "no content"}, "count": 40}],
    )
    export["input_config"]["phases"][0]["concurrency"] = concurrency
    return export


async def test_a_custom_client_with_0_output_tokens_fails(tmp_path: Path) -> None:
    command = client_writing(tmp_path, {"mine-c4": zero_tokens(4), "mine-c1": passing(1)})
    summary = await make_run(tmp_path, aiperf_plan(type="custom", command=command)).run()
    assert summary.state == "failed"
    folder = tmp_path / "benchmark" / "mine-c4"
    assert summary.error == (
        f"concurrency 4 in {folder}: 0 output tokens in 40 request(s): 40 failed (no content x40)"
    )
    assert [(lv.concurrency, lv.passed) for lv in summary.levels] == [(1, True), (4, False)]
    assert read_summary(tmp_path / "benchmark" / "summary.json").state == "failed"


async def test_a_custom_client_failing_more_than_max_error_rate_fails(tmp_path: Path) -> None:
    export = json.loads(json.dumps(EXPORT))  # 6 ok, 2 failed: 25% > 0
    command = client_writing(tmp_path, {"run": export})
    summary = await make_run(tmp_path, aiperf_plan(type="custom", command=command)).run()
    assert summary.state == "failed"
    assert summary.error is not None
    assert "2 of 8 requests failed (25%), more than max_error_rate 0" in summary.error
    lenient = aiperf_plan(type="custom", command=command, max_error_rate=0.5)
    assert (await make_run(tmp_path / "b", lenient).run()).state == "passed"


async def test_a_custom_client_that_completes_fewer_requests_than_it_sent_fails(
    tmp_path: Path,
) -> None:
    export = passing(4)
    export["request_count"] = export["completed_request_count"] = {"avg": 6}
    export["input_config"]["phases"][0]["requests"] = 10
    command = client_writing(tmp_path, {"run": export})
    summary = await make_run(tmp_path, aiperf_plan(type="custom", command=command)).run()
    assert summary.state == "failed"
    assert summary.error == (
        f"concurrency 4 in {tmp_path / 'benchmark' / 'run'}: only 6 of 10 requests completed"
    )


async def test_a_custom_client_without_results_passes_with_a_note_unless_required(
    tmp_path: Path,
) -> None:
    command = client_writing(tmp_path, {})
    summary = await make_run(tmp_path / "a", aiperf_plan(type="custom", command=command)).run()
    assert (summary.state, summary.note) == ("passed", NO_RESULTS_NOTE)
    assert f"note: {NO_RESULTS_NOTE}" in render_summary(summary)
    strict = aiperf_plan(type="custom", command=command, require_results=True)
    summary = await make_run(tmp_path / "b", strict).run()
    assert summary.state == "failed"
    assert summary.error is not None
    assert "left no AIPerf results" in summary.error
    assert "benchmark.require_results" in summary.error


MALFORMED: list[tuple[str, Any, str]] = [
    ("details-a-string", {**EXPORT, "error_summary": [{"error_details": "x", "count": 2}]}, "$"),
    (
        "mixed-counts",
        {
            **EXPORT,
            "error_summary": [
                {"error_details": {"message": "a"}, "count": 2},
                {"error_details": {"message": "b"}, "count": "3"},
            ],
        },
        "count",
    ),
    ("a-list", [1, 2], "Expected `object`"),
    ("metric-a-number", {**EXPORT, "total_osl": 96}, "total_osl"),
    ("stat-a-string", {**EXPORT, "total_osl": {"avg": "96"}}, "total_osl"),
    ("negative-count", {**EXPORT, "total_osl": {"avg": -1}}, "not a count"),
    ("huge", '{"total_osl": {"avg": 1e400}}', "out of range"),
    ("not-json", "{'single': quotes}", "cannot read"),
    ("phases-a-dict", {**EXPORT, "input_config": {"phases": {"profiling": {}}}}, "phases"),
]


@pytest.mark.parametrize(("name", "export", "words"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_export_fails_its_level_naming_the_file(
    tmp_path: Path, name: str, export: Any, words: str
) -> None:
    folder = tmp_path / name
    folder.mkdir()
    text = export if isinstance(export, str) else json.dumps(export)
    (folder / EXPORT_FILE).write_text(text)
    with pytest.raises(ResultsError) as caught:
        read_level(folder, gpus=8, concurrency=4)
    assert str(folder / EXPORT_FILE) in str(caught.value)
    assert words in str(caught.value)
    level = judge_level(
        folder,
        gpus=8,
        concurrency=4,
        exit_code=0,
        requested=6,
        max_error_rate=0.0,
        client_said=None,
    )
    assert not level.passed
    assert level.error is not None
    assert level.error.startswith("concurrency 4: ")
    assert str(folder / EXPORT_FILE) in level.error


async def test_malformed_exports_from_a_custom_client_fail_the_run_and_write_the_summary(
    tmp_path: Path,
) -> None:
    folders = {name: export for name, export, _ in MALFORMED}
    command = client_writing(tmp_path, folders)
    run = make_run(tmp_path, aiperf_plan(type="custom", command=command))
    summary = await run.run()
    assert summary.state == "failed"
    assert len(summary.levels) == len(MALFORMED)
    assert not any(lv.passed for lv in summary.levels)
    assert run.status().state == "failed"
    assert read_summary(tmp_path / "benchmark" / "summary.json").error == summary.error


def test_records_of_another_shape_are_refused_and_a_cut_last_line_is_not(tmp_path: Path) -> None:
    (tmp_path / RECORDS_FILE).write_text('{"error": {"message": "e"}}\n{"metrics": {"output_seq')
    assert read_records(tmp_path) == (0, 1, 0, "e x1")
    (tmp_path / RECORDS_FILE).write_text('{"error": 5}\n{}\n')
    with pytest.raises(ResultsError, match="line 1"):
        read_records(tmp_path)


async def test_every_control_character_a_client_says_is_escaped_on_every_path(
    tmp_path: Path,
) -> None:
    """The client's last ERROR line and its export's error message, both holding every control
    character, through summary.json, status.json's benchmark block, ``status``, ``bench --show``
    and the local runner's ``job failed:`` line."""
    export = zero_tokens(2)
    export["error_summary"][0]["error_details"]["message"] = f"bad{CONTROL}end"
    said = CONTROL.replace("\n", "")  # a newline ends the line: the rest is another one
    command = client_writing(tmp_path, {"c2": export}, code=1, say=f"ERROR {said} done")
    run = make_run(tmp_path, aiperf_plan(type="custom", command=command))
    summary = await run.run()
    assert summary.state == "failed"
    assert summary.error is not None
    assert "ERROR \\x00\\x01" in summary.error  # what it said, escaped
    assert "\\x1b" in summary.error
    level_error = summary.levels[0].error
    assert level_error is not None
    assert "bad\\x00" in level_error
    # summary.json, and its table (bench --show prints render_summary of it)
    on_disk = read_summary(tmp_path / "benchmark" / "summary.json")
    for text in (
        on_disk.error or "",
        *(lv.error or "" for lv in on_disk.levels),
        render_summary(on_disk),
        (tmp_path / "benchmark" / "summary.txt").read_text(),
    ):
        assert not has_control(text.replace("\n", "")), text
    # status.json's block, and `tilert-submit status`
    job = JobDir(tmp_path / "J")
    job.create()
    job.write_status(
        JobStatus(state="failed", model="m", error=summary.error, benchmark=run.status())
    )
    status = job.read_status()
    assert not has_control(status.error or "")
    assert not isinstance(status.benchmark, type(None))
    assert not has_control(benchmark_line(run.status()))
    assert not has_control(render_table(status, None).replace("\n", ""))


def test_status_and_show_escape_what_an_older_writer_left_raw() -> None:
    """A status.json or summary.json written raw (another version): shown escaped all the same."""
    raw = f"said {CONTROL}"
    status = JobStatus(state="failed", model="m", error=raw)
    assert not has_control(render_table(status, None).replace("\n", ""))
    summary = BenchmarkSummary(
        state="failed", error=raw, type="custom", model=raw, router_url="u", note=raw
    )
    assert not has_control(render_summary(summary).replace("\n", ""))


def test_the_final_status_shows_every_agent_in_its_last_state() -> None:
    """A job that ended (its benchmark ended it, say): agents last seen serving are stopped, with
    what they last said; a failed one keeps its reason."""

    def agent(name: str, role: Process, state: AgentState, reason: str) -> JobAgent:
        return JobAgent(
            name=name,
            role=role,
            index=int(name.split("-")[1]),
            node="n1",
            state=state,
            restarts=0,
            reason=reason,
            log="",
            metrics_url=None,
            status_url=None,
        )

    status = JobStatus(
        state="stopped",
        model="m",
        agents=[
            agent("prefill-0", "prefill", "stopped", "stopped on request"),
            agent("decode-0", "decode", "healthy", "serving"),
            agent("decode-1", "decode", "failed", "engine exited with code 1"),
        ],
        router=agent("router-0", "router", "healthy", "serving"),
    )
    last = with_last_states(status, "stopped with the job (stopped)")
    assert [(a.state, a.reason) for a in last.agents] == [
        ("stopped", "stopped on request"),
        ("stopped", "stopped with the job (stopped) (it last said healthy: serving)"),
        ("failed", "engine exited with code 1"),
    ]
    assert last.router is not None
    assert last.router.state == "stopped"


# ---- tilert-submit bench: the recipe's rules for its flags, a folder per run ------------------


@pytest.fixture
def serving_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A job directory whose status.json says ready (nothing serves: bad flags never get there)."""
    job = tmp_path / "j"
    assert submit_main([str(DEMO_RECIPE), "--mock", "--dry-run", "--job-dir", str(job)]) == 0
    status = JobDir(job).read_status()
    JobDir(job).write_status(
        msgspec.structs.replace(status, state="ready", router_url="http://127.0.0.1:9")
    )
    capsys.readouterr()
    return job


BAD_FLAGS = [
    (["--req-rate", "nan"], "--req-rate nan: expected a finite number"),
    (["--duration-s", "-5"], "--duration-s -5: -5 is out of range"),
    (["--warmup-requests", "-3"], "--warmup-requests -3: -3 is out of range"),
    (
        ["--max-error-rate", "5"],
        "--max-error-rate 5: 5 is out of range: it must be from 0 to 1",
    ),
    (["--concurrencies", "4", "4"], "--concurrencies 4 4: level 4 is listed twice"),
    (["--concurrencies", "0"], "--concurrencies 0: 0 is out of range"),
    (["--concurrencies", "four"], "--concurrencies four: expected"),
    (["--num-requests", "0"], "--num-requests 0: 0 is out of range"),
    (["--extra-args=--url=x"], "--extra-args --url=x: --url is set by the agent"),
]


@pytest.mark.parametrize(("flags", "says"), BAD_FLAGS, ids=[f[0][0] for f in BAD_FLAGS])
def test_bench_flags_get_the_recipes_rules(
    serving_job: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    code = submit_main(["bench", str(serving_job), "--isl", "8", "--osl", "8", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err, err
    assert "Traceback" not in err
    assert not (serving_job / "benchmark").exists()  # nothing ran, nothing was made


def test_bench_req_rate_inf_is_as_fast_as_allowed(serving_job: Path) -> None:
    plan = load_plan((serving_job / "plan.json").read_bytes())
    parser = argparse.ArgumentParser()
    bench_add_arguments(parser)
    args = parser.parse_args([str(serving_job), "--isl", "8", "--osl", "8", "--req-rate", "inf"])
    args.concurrencies = ["1,4"]
    result = bench_plan(args, plan)
    assert result.req_rate is None
    assert result.concurrencies == [1, 4]


def test_each_bench_run_gets_its_own_folder(serving_job: Path) -> None:
    job = JobDir(serving_job)
    folders = {new_run_folder(job) for _ in range(3)}  # within one second, most likely
    assert len(folders) == 3
    assert all(f.is_dir() and f.parent == serving_job / "benchmark" for f in folders)


def test_compare_labels_a_job_whose_recipe_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = []
    for name, isl in (("a", 64), ("b", 128)):
        job = JobDir(tmp_path / name)
        job.create()
        files = BenchmarkFiles(job.root / "benchmark")
        summary = BenchmarkSummary(
            state="passed", type="aiperf", model="m", router_url="u", isl=isl
        )
        write_summary(files, summary)
        jobs.append(job)
    jobs[0].recipe.write_bytes(b"name: caf\xe9\n")
    code = submit_main(
        ["bench", "--compare", *(str(j.root) for j in jobs), "--out", str(tmp_path / "o")]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.err
    assert f"{jobs[0].recipe} cannot be read" in out.err
    assert "isl=64" in out.out


# ---- the smaller ones: signals, a budget of its own, the aiperf_command hint -------------------


async def test_a_client_killed_by_a_signal_is_said_so(tmp_path: Path) -> None:
    plan = aiperf_plan(type="custom", command="echo going; kill -KILL $$")
    summary = await make_run(tmp_path, plan).run()
    assert summary.error == "the custom command was killed by SIGKILL: going"
    log = (tmp_path / "logs" / "benchmark.log").read_text()
    assert "it was killed by SIGKILL" in log


async def test_a_custom_client_has_a_budget_of_its_own(tmp_path: Path) -> None:
    plan = aiperf_plan(type="custom", command="echo started; exec sleep 600", timeout_s=1.0)
    run = make_run(tmp_path, plan)
    summary = await run.run()  # bounded by timeout_s (and the stop grace), never by the sleep
    assert summary.state == "failed"
    assert summary.error == (
        "did not end within benchmark.timeout_s (1s); raise it for longer runs"
    )
    assert not run.interrupted  # its own verdict: the head ends the job with it
    assert (
        "out of benchmark.timeout_s: it was killed by SIGTERM"
        in (tmp_path / "logs" / "benchmark.log").read_text()
    )


async def test_a_missing_aiperf_names_the_key_to_set(tmp_path: Path) -> None:
    plan = aiperf_plan(program=[str(tmp_path / "no-aiperf")])
    run = make_run(tmp_path, plan)
    problem = await run.preflight()
    assert problem is not None
    assert "set benchmark.aiperf_command" in problem
    summary = await run.run()  # started all the same (bench skips no preflight, the head does)
    assert summary.error is not None
    assert "cannot start" in summary.error
    assert "set benchmark.aiperf_command" in summary.error
