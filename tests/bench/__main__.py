"""``python -m tests.bench [--quick] [--only NAME,...] [--out bench-results.json]``, or one of
the benchmarks with a command line of its own: ``python -m tests.bench chaos [...]``, ``python -m
tests.bench service [...]``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from tests.bench.results import FIGURES, Figure, table, write

# Which module measures which figures (each measures its own side by side with its reference).
GROUPS = {
    "tests.bench.cli": ("cli_help_ms", "cli_status_ms", "dry_run_64_decode_ms"),
    "tests.bench.reexport": ("reexport_p50_ms", "reexport_ratio"),
    "tests.bench.logpump": ("log_pump_ratio_64k", "log_pump_drop_pct"),
    "tests.bench.reqstat": ("reqstat_us",),
    "tests.bench.follow": ("head_follow_1024_ms", "head_follow_cpu_1024_pct"),
    "tests.bench.idle": ("head_idle_cpu_pct", "agent_idle_cpu_pct", "agent_rss_mb"),
    "tests.bench.bringup": (
        "gate_ms_p50",
        "gate_ms_p95",
        "srtctl_gate_ms_p50",
        "local_ready_s_p50",
        "heal_s",
    ),
    "tests.bench.handover": ("handover_gap_s", "handover_failed"),
    "tests.bench.frontcost": (
        "front_added_ms_p50",
        "front_added_ms_p95",
        "front_stream_ratio",
        "front_cpu_us_per_event",
        "front_cpu_s_per_1k",
        "front_ttfb_p99_x_nginx",
        "service_added_ms_p50",
        "service_cpu_us_per_event",
        "front_events_per_s",
    ),
}
# The benchmarks with a command line of their own (``python -m tests.bench NAME --help``).
COMMANDS = {"chaos": "tests.bench.chaos", "service": "tests.bench.service"}
# Shorthands for a group of figures: ``python -m tests.bench front [--quick] [--out FILE]``.
SHORTHANDS = {"front": "tests.bench.frontcost"}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen benchmarks, print the table, write the results file."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        command: int = importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
        return command
    if argv and argv[0] in SHORTHANDS:
        argv = ["--only", ",".join(GROUPS[SHORTHANDS[argv[0]]]), *argv[1:]]
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench",
        description=__doc__,
        epilog=f"commands: {', '.join(COMMANDS)}; shorthands for --only: {', '.join(SHORTHANDS)}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer runs of each (a smoke run)")
    parser.add_argument(
        "--only",
        metavar="NAME,...",
        default="",
        help="only these figures (comma-separated): " + ", ".join(FIGURES),
    )
    parser.add_argument("--out", default="bench-results.json", help="the results file to write")
    args = parser.parse_args(argv)
    wanted = {n.strip() for n in args.only.split(",") if n.strip()} or set(FIGURES)
    unknown = wanted - set(FIGURES)
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(sorted(unknown))}; known: {', '.join(FIGURES)}")
    figures: list[Figure] = []
    started = time.monotonic()
    for module_name, names in GROUPS.items():
        chosen = wanted & set(names)
        if not chosen:
            continue
        print(f"measuring {', '.join(n for n in names if n in chosen)} ...", flush=True)
        module = importlib.import_module(module_name)
        figures += module.measure(chosen, quick=args.quick)
    figures.sort(key=lambda f: list(FIGURES).index(f.name))
    print()
    print(table(figures))
    write(Path(args.out), figures, {"quick": args.quick, "only": sorted(wanted)})
    took = time.monotonic() - started
    print(f"\n{len(figures)} figures in {took:.0f} s; written to {args.out}")
    return 0 if all(f.passed is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
