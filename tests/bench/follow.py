"""The head agent following many peers: their records appear at once -> status.json shows every one
healthy; beside a plain client asking the same peers once each (the HTTP floor).

The head is a real ``tilert-agent`` (prefill-0 of a ``--mock`` job planned with COUNT decodes);
the peers are one process answering every decode's ``/status`` long poll (``fakes peers``), so
1,024 of them fit on one machine. ``python -m tests.bench.follow`` prints how following and the
head's idle CPU grow with the number of peers (1, 8, 64, 1,024), for docs/performance.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil
import trio

from agent.head.head import GATE_POLL_S
from agent.http.client import build_client
from agent.job.paths import JobDir
from agent.job.records import RendezvousRecord
from tests.bench.idle import ticker_program
from tests.bench.procs import PY, REPO, env, read_status, submit, timed, wait_status
from tests.bench.results import Figure
from tests.kit.jobs import isolated_sets

DEMO = REPO / "recipes" / "local-demo.yaml"
SETTLE_S = 2.0  # after every peer is followed: the first answers' wake-ups are over
IDLE_S = 20.0  # how long the head's CPU is measured while it follows peers, gate closed


class FollowRun:
    """A head agent for ``count`` decodes, and ``count`` fake peers in one process."""

    def __init__(self, root: Path, count: int, state: str = "healthy") -> None:
        self.count = count
        self.state = state
        self.job = root / f"job-{count}"
        # The peers first: the job's ports are chosen after theirs are taken.
        self.peers = subprocess.Popen(
            [PY, "-m", "tests.bench.fakes", "peers", str(count), state],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.peers.stdout is not None
        self.ports: list[int] = json.loads(self.peers.stdout.readline())
        sets, _ = isolated_sets(
            None, f"roles.decode.nodes={count}", f"roles.decode.workers={count}"
        )
        timed(
            submit(str(DEMO), "--mock", "--local", "--dry-run", "--job-dir", str(self.job), *sets)
        )
        self.head = subprocess.Popen(
            [
                PY,
                "-m",
                "agent.main",
                "--role",
                "prefill",
                "--index",
                "0",
                "--job-dir",
                str(self.job),
            ],
            cwd=REPO,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def records(self) -> None:
        """Every decode's record, as its agent would publish it (pointing at the fake peers)."""
        folder = JobDir(self.job).rendezvous
        for i in range(self.count):
            name, port = f"decode-{i}", self.ports[i]
            record = RendezvousRecord(
                name=name,
                role="decode",
                index=i,
                node=f"fake-{i}",
                address="127.0.0.1",
                ports={"http": 1, "ctrl": 2, "agent": port},
                status_url=f"http://127.0.0.1:{port}/{name}/status",
                metrics_url=f"http://127.0.0.1:{port}/{name}/metrics",
            )
            tmp = folder / f".{name}.json.tmp"
            tmp.write_bytes(msgspec.json.encode(record))
            os.replace(tmp, folder / f"{name}.json")

    def follow_ms(self) -> float:
        """Milliseconds from every record in place to status.json showing every decode healthy."""
        wait_status(self.job, ("starting", "waiting"), 120)  # the head's gate loop runs
        self.records()
        start = time.monotonic()
        while time.monotonic() - start < 120:
            status = read_status(self.job)
            decodes = [a for a in status.agents if a.role == "decode"] if status else []
            if len(decodes) == self.count and all(a.state == self.state for a in decodes):
                return (time.monotonic() - start) * 1000
            time.sleep(0.005)
        raise RuntimeError(f"the head did not follow {self.count} peers in 120 s ({self.job})")

    def head_cpu_pct(self, seconds: float) -> tuple[float, float]:
        """The head agent's own CPU (its process, not its engine) over ``seconds``, % of a core;
        beside it, a bare trio process waking as often as the gate loop over the same seconds."""
        ticker = subprocess.Popen([PY, "-c", ticker_program(GATE_POLL_S)], cwd=REPO, env=env())
        try:
            procs = [psutil.Process(self.head.pid), psutil.Process(ticker.pid)]
            before = [sum(p.cpu_times()[:2]) for p in procs]
            time.sleep(seconds)
            after = [sum(p.cpu_times()[:2]) for p in procs]
        finally:
            ticker.kill()
            ticker.wait()
        used = [100.0 * (a - b) / seconds for a, b in zip(after, before, strict=True)]
        return used[0], used[1]

    def close(self) -> None:
        """The head's whole tree (engine, router) and the fake peers, gone."""
        for proc in (self.head, self.peers):
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            for p in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def floor_ms(ports: list[int]) -> float:
    """Milliseconds for the agent's client to ask each peer's /status once, all at once (no head:
    the HTTP part alone; a plain ``httpx.AsyncClient``, one pool for every peer, takes ~30 s)."""

    async def ask() -> float:
        async with build_client() as client:
            start = time.monotonic()
            async with trio.open_nursery() as nursery:
                for i, port in enumerate(ports):
                    url = f"http://127.0.0.1:{port}/decode-{i}/status"
                    nursery.start_soon(client.get, url)
            return (time.monotonic() - start) * 1000

    return trio.run(ask)


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """head_follow_1024_ms, several heads, each beside the floor on the same fake peers; and
    head_follow_cpu_1024_pct, the head's own CPU while it keeps following 1,024 peers that stay
    ``starting`` (the gate closed), beside a bare trio process waking as often as its gate loop."""
    runs = 1 if quick else 3
    figures = []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-follow-") as tmp:
        if "head_follow_1024_ms" in names:
            ours, floor = [], []
            for i in range(runs):
                run = FollowRun(Path(tmp) / str(i), 1024)
                try:
                    ours.append(run.follow_ms())
                    floor.append(floor_ms(run.ports))
                finally:
                    run.close()
            what = "the agent's client asking the 1,024 peers once"
            figures.append(Figure("head_follow_1024_ms", ours, what, floor))
        if "head_follow_cpu_1024_pct" in names:
            cpu, ticker = [], []
            for i in range(runs):
                run = FollowRun(Path(tmp) / f"starting-{i}", 1024, state="starting")
                try:
                    run.follow_ms()
                    time.sleep(SETTLE_S)
                    pct, floor_pct = run.head_cpu_pct(IDLE_S / (2 if quick else 1))
                    cpu.append(pct)
                    ticker.append(floor_pct)
                finally:
                    run.close()
            what = f"a bare trio process waking every {GATE_POLL_S:g} s (the gate loop's pace)"
            figures.append(Figure("head_follow_cpu_1024_pct", cpu, what, ticker, "mean"))
    return figures


def scaling(counts: tuple[int, ...] = (1, 8, 64, 1024), idle_s: float = IDLE_S) -> None:
    """Print, per number of peers: following them (healthy), the floor, and the head's CPU while
    it keeps following them with the gate closed (every peer ``starting``: the head re-evaluates
    every 0.5 s then, every 5 s once serving, so this bounds its serving cost from above)."""
    print(f"{'peers':>6}  {'follow ms':>9}  {'floor ms':>8}  {'head CPU % (waiting)':>20}")
    with tempfile.TemporaryDirectory(prefix="tilert-bench-scaling-") as tmp:
        for count in counts:
            run = FollowRun(Path(tmp) / f"healthy-{count}", count)
            try:
                follow = run.follow_ms()
                floor = floor_ms(run.ports)
            finally:
                run.close()
            run = FollowRun(Path(tmp) / f"starting-{count}", count, state="starting")
            try:
                run.follow_ms()
                time.sleep(SETTLE_S)
                cpu, _ = run.head_cpu_pct(idle_s)
            finally:
                run.close()
            print(f"{count:>6}  {follow:>9.0f}  {floor:>8.0f}  {cpu:>20.2f}", flush=True)


if __name__ == "__main__":
    scaling(idle_s=float(sys.argv[1]) if len(sys.argv) > 1 else IDLE_S)
