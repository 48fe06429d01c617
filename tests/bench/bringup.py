"""Local bring-ups (``tilert-submit recipes/local-demo.yaml --local --mock``, stand-in router),
each round ours beside the same job with srtctl's 5 s polling; healing on some of ours.

- gate: the head's own figure (status.json ``gate.gate_s``: the last worker's ``healthy_at`` to
  the router's process running), checked from outside against the router leader's start time
  (psutil, in 10 ms clock ticks: a lower bound, as the process starts before it is exec'd);
- srtctl: the same job probed every 5 s (srtctl's ``health_check.interval_seconds``); its gate runs
  from the last engine actually answering ``/health`` (polled here every 10 ms) to the router's
  start, which is what users wait for when health is polled every 5 s;
- ready: tilert-submit's start to status.json ``ready``;
- heal: decode-0's engine SIGKILLed -> status.json ``ready`` again (every worker healthy and the
  router proven by a canary), minus the new engine's own start (its time to healthy).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from agent.job.paths import JobDir
from agent.job.records import Gate
from tests.bench.procs import READY_TIMEOUT_S, agent_row, local_job, read_status, wait_status
from tests.bench.results import Figure
from tests.kit.metrics import samples

ENGINES = ("prefill-0", "decode-0", "decode-1")
SRTCTL = ("agent.probe.startup_interval_s=5", "agent.probe.interval_s=5")


@dataclass
class Round:
    """One bring-up: seconds to ready and the gate (ms), as the head saw it and from outside."""

    ready_s: float
    gate_ms: float
    outside_gate_ms: float | None = None
    heal_s: float | None = None
    engine_start_s: float | None = None


def _gate(job: Path) -> Gate:
    status = read_status(job)
    if status is None or not isinstance(status.gate, Gate):
        raise RuntimeError(f"{job}: status.json has no gate block once ready")
    return status.gate


class _EngineWatch:
    """Each engine's /health polled every 10 ms from the moment its record names its port: when
    it first answered (under 5 s polling, the gate users wait for starts there)."""

    def __init__(self, job: Path) -> None:
        self.job = job
        self.first_ok: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _health_url(self, name: str) -> str | None:
        try:
            record = json.loads(JobDir(self.job).record(name).read_text())
        except (OSError, ValueError):
            return None
        return f"http://{record['address']}:{record['ports']['http']}/health"

    def _run(self) -> None:
        with httpx.Client(timeout=0.5) as client:
            while not self._stop.is_set() and len(self.first_ok) < len(ENGINES):
                for name in ENGINES:
                    url = None if name in self.first_ok else self._health_url(name)
                    if url is None:
                        continue
                    try:
                        ok = client.get(url).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        self.first_ok[name] = time.time()
                time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _process_clock_offset() -> float:
    """psutil's start time of a process started now, minus the wall clock then: its boot time
    is whole seconds, so start times are off the wall clock by up to a second."""
    before = time.time()
    child = subprocess.Popen(["true"])
    try:
        return psutil.Process(child.pid).create_time() - before
    finally:
        child.wait()


def _outside_gate_ms(status_urls: dict[str, str]) -> float:
    """The router leader's start (psutil, in clock ticks, corrected to the wall clock) minus the
    last worker's own healthy_at."""
    agents = {name: httpx.get(url, timeout=10).json() for name, url in status_urls.items()}
    last = max(float(a["healthy_at"]) for a in agents.values())
    started = psutil.Process(agents["prefill-0"]["router"]["pid"]).create_time()
    return (started - _process_clock_offset() - last) * 1000


def _heal(job: Path) -> tuple[float, float]:
    """(seconds from decode-0's engine SIGKILL to ``ready`` again, the new engine's start)."""
    status = read_status(job)
    assert status is not None
    row = agent_row(status, "decode-0")
    assert row.status_url is not None
    assert row.metrics_url is not None
    before = httpx.get(row.status_url, timeout=10).json()
    killed = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    while time.monotonic() - killed < READY_TIMEOUT_S:
        status = read_status(job)
        if status is not None and status.state == "ready":
            again = agent_row(status, "decode-0")
            if again.restarts > row.restarts:
                healed = time.monotonic() - killed
                break
        time.sleep(0.005)
    else:
        raise RuntimeError(f"{job}: not ready again after decode-0's engine was killed")
    page = httpx.get(row.metrics_url, timeout=10).text
    start = next(
        s.value
        for s in samples(page)
        if s.name == "tilert_agent_time_to_healthy_seconds" and s.labels["component"] == "engine"
    )
    return healed, start


def _ours(root: Path, heal: bool) -> Round:
    with local_job(root) as (job, start):
        status = wait_status(job.job, ("ready",), READY_TIMEOUT_S)
        result = Round(ready_s=time.monotonic() - start, gate_ms=_gate(job.job).gate_s * 1000)
        urls = {a.name: a.status_url for a in status.agents if a.status_url}
        result.outside_gate_ms = _outside_gate_ms(urls)
        if heal:
            result.heal_s, result.engine_start_s = _heal(job.job)
    return result


def _srtctl(root: Path) -> Round:
    with local_job(root, *SRTCTL) as (job, start):
        watch = _EngineWatch(job.job)
        try:
            wait_status(job.job, ("ready",), READY_TIMEOUT_S)
        finally:
            watch.close()
        ready_s = time.monotonic() - start
        gate = _gate(job.job)
    return Round(ready_s, (gate.router_started_at - max(watch.first_ok.values())) * 1000)


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """The bring-up figures: ``rounds`` of ours beside srtctl's cadence, healing on a few."""
    rounds, healing = (3, 1) if quick else (20, 5)
    ours: list[Round] = []
    theirs: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-bringup-") as tmp:
        for i in range(rounds):
            ours.append(_ours(Path(tmp) / f"ours-{i}", heal=i < healing and "heal_s" in names))
            if names & {"srtctl_gate_ms_p50", "local_ready_s_p50", "gate_ms_p50", "gate_ms_p95"}:
                theirs.append(_srtctl(Path(tmp) / f"srtctl-{i}"))
    gates = [r.gate_ms for r in ours]
    srtctl_gates = [r.gate_ms for r in theirs]
    outside = [r.outside_gate_ms for r in ours if r.outside_gate_ms is not None]
    note = (
        f"from outside (the router's start in 10 ms clock ticks): median "
        f"{statistics.median(outside):.0f} ms over {len(outside)}"
        if outside
        else ""
    )
    heals = [
        (r.heal_s, r.engine_start_s)
        for r in ours
        if r.heal_s is not None and r.engine_start_s is not None
    ]
    figures = [
        Figure("gate_ms_p50", gates, "srtctl's 5 s polling", srtctl_gates, "p50", note),
        Figure("gate_ms_p95", gates, "srtctl's 5 s polling", srtctl_gates, "p95"),
        Figure("srtctl_gate_ms_p50", srtctl_gates, "ours", gates, "p50"),
        Figure(
            "local_ready_s_p50",
            [r.ready_s for r in ours],
            "srtctl's 5 s polling",
            [r.ready_s for r in theirs],
            "p50",
        ),
        Figure(
            "heal_s",
            [healed - start for healed, start in heals],
            "the new engine's own start (subtracted)",
            [start for _, start in heals],
        ),
    ]
    return [f for f in figures if f.name in names]
