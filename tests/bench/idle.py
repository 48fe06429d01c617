"""A ready job left alone, scraped every 5 s as Prometheus would: the head agent's and a decode
agent's own CPU (their processes, not their engines), and the decode agent's memory; beside a
bare trio process that wakes as often as the agent's probes (the floor of any Python watcher).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from agent.recipe.model import Probe
from tests.bench.procs import PY, REPO, env, ready_job
from tests.bench.results import Figure

SCRAPE_S = 5.0
SETTLE_S = 3.0  # after ready: the canaries' connections closed, the first scrape's cold parse
# What any agent imports; the floor of an agent's memory. And a process that wakes as often as
# the agent's liveness probes at their default interval (agent.probe.interval_s; the demo recipe
# probes every 0.5 s, the figure is for the default) and does nothing else.
PROBE_S = Probe().interval_s
LIBRARIES = "import trio, httpx, hypercorn, prometheus_client, psutil, msgspec, yaml"


def ticker_program(every_s: float) -> str:
    """A Python program that imports what an agent imports and wakes every ``every_s``."""
    return (
        f"{LIBRARIES}\nasync def main():\n    while True:\n        await trio.sleep({every_s})\n"
        "trio.run(main)"
    )


def _agent(job: Path, role: str, index: int) -> psutil.Process:
    """The agent process of ``role``-``index`` (not its engine)."""
    wanted = ["--role", role, "--index", str(index), "--job-dir", str(job)]
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "agent.main" in cmd and all(part in cmd for part in wanted):
            return proc
    raise RuntimeError(f"no agent {role}-{index} of {job}")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """CPU per 5 s scrape interval (% of a core) and RSS (MB) sampled at each scrape."""
    window_s = 15.0 if quick else 60.0
    head_cpu, decode_cpu, ticker_cpu, rss, floor_rss = [], [], [], [], []
    ticker = subprocess.Popen([PY, "-c", ticker_program(PROBE_S)], cwd=REPO, env=env())
    try:
        with (
            tempfile.TemporaryDirectory(prefix="tilert-bench-idle-") as tmp,
            ready_job(Path(tmp), f"agent.probe.interval_s={PROBE_S:g}") as (job, status, _),
        ):
            head, decode = _agent(job.job, "prefill", 0), _agent(job.job, "decode", 0)
            floor = psutil.Process(ticker.pid)
            urls = [a.metrics_url for a in status.agents if a.metrics_url]
            time.sleep(SETTLE_S)
            with httpx.Client(timeout=10) as client:
                for _ in range(int(window_s / SCRAPE_S)):
                    before = [_cpu_s(p) for p in (head, decode, floor)]
                    start = time.monotonic()
                    for url in urls:
                        client.get(url).raise_for_status()
                    time.sleep(max(0.0, start + SCRAPE_S - time.monotonic()))
                    took = time.monotonic() - start
                    after = [_cpu_s(p) for p in (head, decode, floor)]
                    used = [100.0 * (a - b) / took for a, b in zip(after, before, strict=True)]
                    head_cpu.append(used[0])
                    decode_cpu.append(used[1])
                    ticker_cpu.append(used[2])
                    rss.append(decode.memory_info().rss / 1e6)
                    floor_rss.append(floor.memory_info().rss / 1e6)
    finally:
        ticker.kill()
        ticker.wait()
    ticker_what = f"a bare trio process waking every {PROBE_S:g} s"
    figures = [
        Figure("head_idle_cpu_pct", head_cpu, ticker_what, ticker_cpu, "mean"),
        Figure("agent_idle_cpu_pct", decode_cpu, ticker_what, ticker_cpu, "mean"),
        Figure("agent_rss_mb", rss, "a bare Python with the agent's libraries", floor_rss),
    ]
    return [f for f in figures if f.name in names]
