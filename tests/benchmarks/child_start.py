"""Benchmark: how long starting a child takes the agent, and how long until the program runs.

Run on demand (not part of the test suite), from the repository root:

    .venv/bin/python -m tests.benchmarks.child_start [--runs 200] [--ballast-mb 150]

It starts ``date +%s%N`` through ``agent.launch.child.Child`` (the path every engine, router and
``--local`` agent takes) from a process made agent-sized by ``--ballast-mb`` of touched memory (a
fork copies the page tables, so a bigger parent forks slower; vfork does not), and prints, as
median / p95 / max in ms:

- ``blocked``: how long the constructor held the calling (trio) thread;
- ``to exec``: from the call until the program itself ran (the time ``date`` printed);
- ``with lifeline``: the constructor plus ``attach_lifeline`` (a whole ``ProcessLauncher.start``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import trio

from agent.launch.child import Child


def _stats(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p95 = ms[min(len(ms) - 1, int(len(ms) * 0.95))]
    return f"median {statistics.median(ms):6.2f}  p95 {p95:6.2f}  max {ms[-1]:6.2f} ms"


async def _one(env: dict[str, str], lifeline: bool) -> tuple[float, float, float]:
    t0 = time.time()
    c0 = time.perf_counter()
    child = Child(["date", "+%s%N"], env, None)
    blocked = time.perf_counter() - c0
    if lifeline:
        child.attach_lifeline()
    whole = time.perf_counter() - c0
    out = b""
    while chunk := await child.output.receive_some(4096):
        out += chunk
    await child.wait()
    await child.output.aclose()
    return blocked, int(out.strip()) / 1e9 - t0, whole


async def _measure(runs: int) -> tuple[list[float], list[float], list[float]]:
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    blocked, to_exec, whole = [], [], []
    for i in range(runs):
        b, e, w = await _one(env, lifeline=i % 2 == 1)
        blocked.append(b)
        to_exec.append(e)
        if i % 2 == 1:
            whole.append(w)
    return blocked, to_exec, whole


def main() -> None:
    """Start ``--runs`` children and print the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--ballast-mb", type=int, default=150)
    args = parser.parse_args()
    ballast = bytearray(args.ballast_mb << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    blocked, to_exec, whole = trio.run(_measure, args.runs)
    print(f"{args.runs} starts from a {args.ballast_mb} MB parent:")
    print(f"  blocked        {_stats(blocked)}")
    print(f"  to exec        {_stats(to_exec)}")
    print(f"  with lifeline  {_stats(whole)}")


if __name__ == "__main__":
    main()
