"""``tilert-submit bench``: benchmark a ready job from here, show its results, compare jobs.

- ``bench J [--concurrencies 1 4 16] [--isl N] [--osl N] ...``: AIPerf from where tilert-submit
  runs against the job's router (it must be ``ready``), the recipe's ``benchmark:`` values as
  defaults, the results under ``J/benchmark/<time>/``; the job is not touched. Exit 0 when the
  benchmark passed, 1 when it failed (the table says which level and why), 2 for bad input.
- ``bench J --show``: the table of the job's latest results (the head's or a ``bench`` run's).
- ``bench --compare J1 J2 ...``: their latest results in one table and one set of plots, each
  job labelled by what differs between their recipes (docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import trio
import yaml

from agent.benchmark.plots import PlotsUnavailable, Series, make_plots
from agent.benchmark.runner import BenchmarkRun
from agent.benchmark.summary import level_rows, render_rows, render_summary
from agent.benchmark.target import BenchTarget, job_gpus
from agent.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, BadInput
from agent.job.benchmark import (
    BENCHMARK_DIR,
    BenchmarkFiles,
    BenchmarkPlan,
    BenchmarkSummary,
    read_summary,
)
from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan
from agent.job.vocab import SERVING_STATES
from agent.launch import LaunchSpec, make_launcher
from agent.launch.commands import arg_value, benchmark_env
from agent.problems import printable
from agent.recipe.rules.benchmark import request_rate
from submit.statusview import staleness

# Where tilert-submit bench writes its own log (beside its results).
LOG_NAME = "benchmark.log"
STOP_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's arguments."""
    parser.add_argument("job_dir", metavar="J", nargs="?", help="the job directory")
    parser.add_argument("--show", action="store_true", help="print the latest results of J")
    parser.add_argument(
        "--compare",
        metavar="J",
        nargs="+",
        help="put the latest results of these jobs in one table and one set of plots",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where --compare writes its plots (default ./tilert-compare-<time>)",
    )
    parser.add_argument(
        "--concurrencies",
        metavar="N",
        nargs="+",
        help="concurrency levels (e.g. 1 4 16, or 1,4,16); default: the recipe's",
    )
    parser.add_argument("--isl", type=int, metavar="N", help="input tokens per request")
    parser.add_argument("--osl", type=int, metavar="N", help="output tokens per request")
    parser.add_argument("--num-requests", type=int, metavar="N", help="requests per level")
    parser.add_argument("--duration-s", type=float, metavar="S", help="seconds per level")
    parser.add_argument("--warmup-requests", type=int, metavar="N", help="warmup requests")
    parser.add_argument("--req-rate", type=float, metavar="R", help="requests per second")
    parser.add_argument("--max-error-rate", type=float, metavar="F", help="failed requests allowed")
    parser.add_argument("--tokenizer", metavar="T", help="tokenizer path or hub id")
    parser.add_argument("--aiperf-command", metavar="CMD", help="the aiperf executable")
    parser.add_argument(
        "--extra-args", metavar="ARG", nargs="+", default=None, help="more aiperf flags, as given"
    )


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"tilert-submit bench: {message}", file=sys.stderr)
    return code


class BenchFlagsError(BadInput, ValueError):
    """A ``bench`` flag the recipe's rules refuse, or flags missing where the recipe has no aiperf
    benchmark; the message names each flag."""


def _levels(words: list[str]) -> list[int | str]:
    """``--concurrencies 1 4 16`` (or ``1,4,16``, ``1x4x16``): the levels, a word that is no
    whole number kept as it is for the recipe's check to name."""
    pieces = [w.strip() for word in words for w in word.replace("x", ",").split(",") if w.strip()]
    return [int(p) if p.lstrip("-").isdigit() else p for p in pieces]


# The flags that set a benchmark key, with the key's recipe name.
_FLAG_KEYS = (
    "isl",
    "osl",
    "num_requests",
    "duration_s",
    "warmup_requests",
    "req_rate",
    "max_error_rate",
    "tokenizer",
    "aiperf_command",
    "extra_args",
)


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark keys the flags give; BenchFlagsError naming each flag the recipe's rules refuse
    (the same ranges and messages as in a recipe)."""
    from agent.recipe.benchvalues import check_benchmark_values

    values = {k: getattr(args, k) for k in _FLAG_KEYS if getattr(args, k, None) is not None}
    command = values.get("aiperf_command")
    if isinstance(command, str) and "/" in command:
        # AIPerf runs here, where tilert-submit runs: a relative path is this folder's.
        values["aiperf_command"] = os.path.abspath(command)
    if args.concurrencies:
        values["concurrencies"] = _levels(args.concurrencies)
    if values.get("req_rate") == math.inf:
        values["req_rate"] = "inf"  # --req-rate inf: as fast as the levels allow, as in a recipe
    problems = check_benchmark_values(values)
    if problems:
        lines = []
        for p in problems:
            key = p.path.removeprefix("benchmark.").split(".")[0].split("[")[0]
            given = values.get(key)
            shown = (
                " ".join(map(str, given))
                if isinstance(given, list)
                else f"{given:g}"
                if isinstance(given, float)
                else given
            )
            lines.append(f"--{key.replace('_', '-')} {shown}: {p.message}; {p.hint}")
        raise BenchFlagsError("\n".join(lines))
    return values


def bench_plan(args: argparse.Namespace, plan: Plan) -> BenchmarkPlan:
    """The recipe's aiperf benchmark (or an empty one) with the flags given on top (BenchFlagsError
    naming the flag, checked by the recipe's rules)."""
    given = plan.benchmark
    base = (
        given
        if isinstance(given, BenchmarkPlan) and given.type == "aiperf"
        else BenchmarkPlan(
            type="aiperf",
            keep_serving=True,
            image=None,
            placement="head",
            env=given.env if isinstance(given, BenchmarkPlan) else {},
            secret_env=given.secret_env if isinstance(given, BenchmarkPlan) else [],
            stop_grace_s=STOP_GRACE_S,
            program=["aiperf"],
        )
    )
    values = _flag_values(args)
    changes: dict[str, Any] = {"keep_serving": True, "image": None, "placement": "head"}
    for key in ("concurrencies", "isl", "osl", "warmup_requests", "max_error_rate", "tokenizer"):
        if key in values:
            changes[key] = values[key]
    if "req_rate" in values:
        changes["req_rate"] = request_rate(values["req_rate"])
    if "num_requests" in values:
        changes.update(num_requests=values["num_requests"], duration_s=None)
    if "duration_s" in values:
        changes.update(duration_s=values["duration_s"], num_requests=None)
    if "aiperf_command" in values:
        changes["program"] = [values["aiperf_command"]]
    if "extra_args" in values:
        changes["extra_args"] = list(values["extra_args"])
    result = msgspec.structs.replace(base, **changes)
    missing = [
        f"--{name}"
        for name, value in (("isl", result.isl), ("osl", result.osl))
        if not value or value < 1
    ]
    if not result.concurrencies:
        missing.append("--concurrencies")
    if missing:
        raise BenchFlagsError(
            f"the recipe has no aiperf benchmark to take them from: give {', '.join(missing)}"
        )
    return result


def _run(args: argparse.Namespace, job: JobDir) -> int:
    try:
        status = job.read_status()
        plan = load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        return _fail(f"{job.root} is not a readable job directory: {exc}")
    try:  # bad flags are bad input whatever the job's state
        bench = bench_plan(args, plan)
    except BenchFlagsError as exc:
        return _fail(str(exc), exc.exit_code)
    stale = staleness(status)
    if status.state not in SERVING_STATES or stale or not status.router_url:
        why = f" ({stale})" if stale else ""
        return _fail(
            f"the job is {status.state}{why}, not ready: bench measures a job that serves", 1
        )
    tokenizer = bench.tokenizer or arg_value(plan.router.args, "--model-path")
    target = BenchTarget(
        router_url=status.router_url,
        model=status.model,
        tokenizer=tokenizer,
        metrics_urls=tuple(a.metrics_url for a in status.agents if a.metrics_url),
        gpus=job_gpus(plan),
        job_dir=job.root,
    )
    try:
        files = BenchmarkFiles(new_run_folder(job))
    except OSError as exc:
        return _fail(f"cannot make a results folder in {job.root / BENCHMARK_DIR}: {exc}", 1)
    log = logging.getLogger("tilert-submit.bench")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    def build(name: str, argv: list[str], env: dict[str, str], _image: str | None) -> LaunchSpec:
        # Where tilert-submit runs there is no pyxis: the client runs here, as it is.
        return LaunchSpec(name=name, argv=argv, env=env)

    run = BenchmarkRun(
        bench,
        target,
        files,
        launcher=make_launcher("process", slurm_job_id=None, node=None),
        launch_spec=build,
        env=benchmark_env(plan, bench),
        log_path=files.root / LOG_NAME,
        log_max_bytes=plan.agent.log_max_bytes,
        log_backups=plan.agent.log_backups,
        log=log,
    )
    problem = trio.run(run.preflight)
    if problem is not None:
        return _fail(problem, EXIT_RUNTIME)
    print(
        f"benchmarking {status.model} at {status.router_url}; results in {files.root}", flush=True
    )

    async def main() -> BenchmarkSummary:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        run.stop(f"interrupted ({signal.Signals(signum).name})")
                        return

            nursery.start_soon(on_signal)
            summary = await run.run()
            nursery.cancel_scope.cancel()
        return summary

    summary = trio.run(main)
    print(render_summary(summary))
    print(f"results: {files.root}")
    return 0 if summary.state == "passed" else EXIT_RUNTIME


def new_run_folder(job: JobDir) -> Path:
    """``J/benchmark/<time>``, made here and now: a second run in the same second gets
    ``<time>-1`` (each run its own folder, never another's)."""
    parent = job.root / BENCHMARK_DIR
    parent.mkdir(parents=True, exist_ok=True)
    base = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        folder = parent / (base if n == 0 else f"{base}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"{parent / base}-* all exist")


def latest(job: JobDir) -> Path | None:
    """The newest summary.json of a job: the head's or one of ``bench``'s."""
    root = job.root / BENCHMARK_DIR
    found = [p for p in (root / "summary.json", *root.glob("*/summary.json")) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _show(job: JobDir) -> int:
    path = latest(job)
    if path is None:
        return _fail(f"no benchmark results in {job.root / BENCHMARK_DIR}", EXIT_RUNTIME)
    try:
        summary = read_summary(path)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _fail(f"cannot read {path}: {exc}", EXIT_RUNTIME)
    print(render_summary(summary))
    print(f"results: {path.parent}")
    return 0


def _flat(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {
        prefix: yaml.safe_dump(data, default_flow_style=True).strip().removesuffix("...").strip()
    }


# Recipe keys that say how a job is supervised or measured, not what it serves with: a label
# names the serving differences, and the run's own settings (``run.*``) for the measurement.
_NOT_SERVING = ("agent.", "benchmark.", "slurm.", "name")
MAX_LABEL_KEYS = 3


def differences(facts: list[dict[str, str]]) -> list[str]:
    """Each job's label: the values in which its recipe (serving keys) and run differ."""
    keys = sorted({k for f in facts for k in f if not k.startswith(_NOT_SERVING)})
    differ = [k for k in keys if len({f.get(k, "-") for f in facts}) > 1]
    short = {k: k.rsplit(".", 1)[-1] for k in differ}
    if len(set(short.values())) < len(short):
        short = {k: k for k in differ}
    labels = []
    for f in facts:
        parts = [f"{short[k]}={f.get(k, '-')}" for k in differ[:MAX_LABEL_KEYS]]
        if len(differ) > MAX_LABEL_KEYS:
            parts.append(f"+{len(differ) - MAX_LABEL_KEYS} more")
        labels.append(", ".join(parts))
    return labels


def _recipe_facts(job: JobDir) -> Any:
    """The job's recipe.yaml as data, for its label; {} (said on stderr) when it cannot be read:
    the job is then labelled by its run's settings only."""
    if not job.recipe.is_file():
        return {}
    try:
        return yaml.safe_load(job.recipe.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as exc:  # UnicodeDecodeError is a ValueError
        print(
            f"tilert-submit bench: {job.recipe} cannot be read ({printable(str(exc))[:200]}): "
            "this job is labelled by its run's settings only",
            file=sys.stderr,
        )
        return {}


def _compare(args: argparse.Namespace) -> int:
    jobs = [JobDir(Path(j)) for j in args.compare]
    summaries: list[BenchmarkSummary] = []
    facts: list[dict[str, str]] = []
    for job in jobs:
        path = latest(job)
        if path is None:
            return _fail(f"no benchmark results in {job.root / BENCHMARK_DIR}", EXIT_RUNTIME)
        try:
            summary = read_summary(path)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _fail(f"cannot read {path}: {exc}", EXIT_RUNTIME)
        recipe = _recipe_facts(job)
        run = {f"run.{k}": getattr(summary, k) for k in ("isl", "osl", "num_requests", "req_rate")}
        facts.append({**_flat(recipe or {}), **_flat(run)})
        summaries.append(summary)
    labels = differences(facts)
    # Nothing differs (the same recipe run twice): the job directories tell them apart.
    labels = [label or job.root.name for label, job in zip(labels, jobs, strict=True)]
    rows = [
        row
        for label, summary in zip(labels, summaries, strict=True)
        for row in level_rows(summary.levels, label)
    ]
    print(render_rows(rows, labelled=True))
    print("(latencies in ms)")
    for label, summary, job in zip(labels, summaries, jobs, strict=True):
        verdict = summary.state + (f": {summary.error}" if summary.error else "")
        print(f"{label}: {job.root}: {verdict}")
    out = Path(args.out or f"tilert-compare-{time.strftime('%Y%m%d-%H%M%S')}")
    series = [Series(label, s.levels) for label, s in zip(labels, summaries, strict=True)]
    try:
        written = make_plots(series, out, "comparison")
    except PlotsUnavailable as exc:
        print(f"plots: {exc}")
        return 0
    print("plots: " + ", ".join(str(p) for p in written))
    return 0


def main(args: argparse.Namespace) -> int:
    """Run, show or compare; see the module docstring for the exit codes."""
    if args.compare:
        if args.job_dir:
            return _fail("give the jobs after --compare only (bench --compare J1 J2 ...)")
        return _compare(args)
    if not args.job_dir:
        return _fail("give the job directory J (or --compare J1 J2 ...)")
    job = JobDir(Path(args.job_dir))
    if not job.status.is_file():
        return _fail(f"{args.job_dir} is not a job directory (no status.json)")
    try:
        return _show(job) if args.show else _run(args, job)
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python's final flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
