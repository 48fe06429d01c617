"""Benchmark: how fast a job becomes ready, and the gate latency, side by side with slow polling.

Run on demand (not part of the test suite), from the repository root:

    .venv/bin/python -m tests.benchmarks.bring_up [--runs 3] [--router-python PATH]

Each round starts the local demo (``--local --mock``) twice, alternating: once with our probing
(startup probe every 50 ms, peers long-polled) and once with srtctl's cadence (health polled every
5 s, the TileRT recipes' ``interval_seconds``). Both runs share the machine at the same moment, so
the ratio is meaningful on a noisy host even when the absolute numbers are not. It prints, per
mode, the median time from submit to ``ready`` and the head's gate latency (last worker healthy
-> router started, from ``tilert_agent_gate_latency_seconds``).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from agent.job.paths import JobDir
from tests.infra.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "local-demo.yaml"
MODES = {
    "tilert-agent (50 ms probes, long-poll)": [],
    "srtctl cadence (5 s polling)": [
        "agent.probe.startup_interval_s=5",
        "agent.probe.interval_s=5",
    ],
}
READY_TIMEOUT_S = 120.0


def one_run(sets: list[str], router_python: str | None, work: Path) -> tuple[float, float]:
    """Submit the demo locally, wait for ready; (seconds to ready, gate latency seconds)."""
    job = work / f"job-{time.monotonic_ns()}"
    args = [
        sys.executable,
        "-m",
        "submit.cli",
        str(RECIPE),
        "--local",
        "--mock",
        "--job-dir",
        str(job),
    ]
    ports = [
        f"agent.router_port={free_port()}",
        f"agent.ports.prefill.http={free_port()}",
        f"agent.ports.prefill.agent={free_port()}",
    ]
    extra = [*ports, *sets] + ([f"agent.router_python={router_python}"] if router_python else [])
    for item in extra:
        args += ["--set", item]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        jd = JobDir(job)
        while True:
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"not ready within {READY_TIMEOUT_S:g}s: see {job}/logs")
            try:
                status = jd.read_status()
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                status = None
            if status is not None and status.state == "ready":
                break
            if status is not None and status.state == "failed":
                raise RuntimeError(f"job failed: {status.error}")
            time.sleep(0.01)
        ready_s = time.monotonic() - t0
        head = next(a for a in status.agents if a.name == "prefill-0")
        assert head.metrics_url
        page = httpx.get(head.metrics_url, timeout=5).text
        gate = next(
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("tilert_agent_gate_latency_seconds{")
        )
        return ready_s, gate
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> int:
    """Alternate the modes for --runs rounds and print medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--router-python",
        default=os.environ.get("TILERT_ROUTER_PYTHON"),
        help="a python that can import tilert.pd_vllm.pd_router (default: $TILERT_ROUTER_PYTHON; "
        "else the router stand-in runs)",
    )
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="tilert-bench-") as tmp:
        for round_no in range(args.runs):
            for mode, sets in MODES.items():
                ready, gate = one_run(sets, args.router_python, Path(tmp))
                results[mode].append((ready, gate))
                print(
                    f"round {round_no + 1}: {mode}: ready {ready:.2f}s, gate {gate * 1000:.1f} ms"
                )
    print()
    medians = {}
    for mode, runs in results.items():
        ready = statistics.median(r for r, _ in runs)
        gate = statistics.median(g for _, g in runs)
        medians[mode] = ready
        print(f"{mode:42s} median ready {ready:6.2f}s   median gate latency {gate * 1000:7.1f} ms")
    ours, theirs = medians.values()
    print(
        f"\nready-time ratio (srtctl cadence / ours): {theirs / ours:.1f}x over {args.runs} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
