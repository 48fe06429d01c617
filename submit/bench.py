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
from agent.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
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


def _levels(words: list[str]) -> list[int]:
    levels = [int(w) for word in words for w in word.replace("x", ",").split(",") if w.strip()]
    if not levels or any(level < 1 for level in levels):
        raise ValueError("levels must be 1 or more")
    return levels


def bench_plan(args: argparse.Namespace, plan: Plan) -> BenchmarkPlan:
    """The recipe's aiperf benchmark (or an empty one) with the flags given on top (ValueError)."""
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
    changes: dict[str, Any] = {"keep_serving": True, "image": None, "placement": "head"}
    if args.concurrencies:
        changes["concurrencies"] = _levels(args.concurrencies)
    for flag in ("isl", "osl", "warmup_requests", "req_rate", "max_error_rate", "tokenizer"):
        value = getattr(args, flag)
        if value is not None:
            changes[flag] = value
    if args.num_requests is not None:
        changes.update(num_requests=args.num_requests, duration_s=None)
    if args.duration_s is not None:
        changes.update(duration_s=args.duration_s, num_requests=None)
    if args.aiperf_command:
        changes["program"] = [args.aiperf_command]
    if args.extra_args is not None:
        changes["extra_args"] = list(args.extra_args)
    result = msgspec.structs.replace(base, **changes)
    missing = [
        f"--{name}"
        for name, value in (("isl", result.isl), ("osl", result.osl))
        if not value or value < 1
    ]
    if not result.concurrencies:
        missing.append("--concurrencies")
    if missing:
        raise ValueError(
            f"the recipe has no aiperf benchmark to take them from: give {', '.join(missing)}"
        )
    if result.num_requests is not None and result.num_requests < 1:
        raise ValueError("--num-requests must be 1 or more")
    return result


def _run(args: argparse.Namespace, job: JobDir) -> int:
    try:
        status = job.read_status()
        plan = load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        return _fail(f"{job.root} is not a readable job directory: {exc}")
    stale = staleness(status)
    if status.state not in SERVING_STATES or stale or not status.router_url:
        why = f" ({stale})" if stale else ""
        return _fail(
            f"the job is {status.state}{why}, not ready: bench measures a job that serves", 1
        )
    try:
        bench = bench_plan(args, plan)
    except ValueError as exc:
        return _fail(str(exc))
    tokenizer = bench.tokenizer or arg_value(plan.router.args, "--model-path")
    target = BenchTarget(
        router_url=status.router_url,
        model=status.model,
        tokenizer=tokenizer,
        metrics_urls=tuple(a.metrics_url for a in status.agents if a.metrics_url),
        gpus=job_gpus(plan),
        job_dir=job.root,
    )
    files = BenchmarkFiles(job.root / BENCHMARK_DIR / time.strftime("%Y%m%d-%H%M%S"))
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
            recipe = yaml.safe_load(job.recipe.read_text()) if job.recipe.is_file() else {}
        except (OSError, yaml.YAMLError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _fail(f"cannot read {job.root}: {exc}", EXIT_RUNTIME)
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
