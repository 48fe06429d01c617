"""``python -m tests.bench service [--duration S] [--clients N] [--out FILE]``: a service of 2
cells (``tilert-submit serve --local --mock``, cells of 1 prefill + 1 decode with a three-minute
local time limit) under a steady streaming load (``tests.bench.chaosload``) for a bounded time:
successions as the cells near their limit, one cell's prefill made to crash-loop (its cell is
replaced), the service front SIGKILLed and started again (it adopts its cells).

It prints per event (each succession, the crash-loop and its replacement, the front's restart,
the whole run): the requests that overlapped it, those lost (failed), cut visibly
(``stream_truncated``), waiting more than 1 s for their first byte, the time with no ready cell,
and the nodes held (live cells x their nodes), then the nodes held over time; exits 1 naming each
target missed (docs/performance.md, "The service benchmark").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.bench.chaosload import ChaosLoad
from tests.bench.chaosplan import Request
from tests.bench.procs import env
from tests.infra.ports import free_port
from tests.kit.scenarios import ANSWER
from tests.kit.service import (
    ServeProc,
    cluster_file,
    crash_env,
    crash_loop_prefill,
    service_sets,
)

MODEL = "demo-model"
NODES_PER_CELL = 2  # 1 prefill + 1 decode
MAX_CELLS = 3  # service.cells + 1 (the default)
READY_S = 180.0
SAMPLE_S = 0.5
FRONT_BACK_S = 10.0
WAITED_S = 1.0
LIVE = ("submitted", "starting", "ready", "retiring")


@dataclass
class Sample:
    """One look at service.json (wall seconds)."""

    at: float
    ready: int
    live: int


@dataclass
class Event:
    """One thing that happened to the service, from ``start`` to ``end`` (wall seconds)."""

    label: str
    kind: str  # succession, failure, front
    start: float
    end: float
    requests: int = 0
    lost: int = 0
    truncated: int = 0
    waited: int = 0
    no_ready_s: float = 0.0
    nodes_max: int = 0
    note: str = ""
    misses: list[str] = field(default_factory=list)


class Sampler:
    """A thread reading service.json every SAMPLE_S: ready and live cells over time."""

    def __init__(self, serve: ServeProc) -> None:
        self.serve = serve
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            cells = self.serve.service().get("cells", [])
            live = [
                c for c in cells if c["state"] in ("submitted", "starting", "ready", "retiring")
            ]
            ready = sum(1 for c in cells if c["state"] == "ready")
            self.samples.append(Sample(time.time(), ready, len(live)))

    def finish(self) -> list[Sample]:
        """Stop sampling; every sample."""
        self.stop.set()
        self.thread.join(5)
        return list(self.samples)


def _log_time(line: str) -> float:
    """The wall time of a ``service.log`` line (``%Y-%m-%d %H:%M:%S,mmm``)."""
    stamp, millis = line[:23].split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def log_events(log: str, drain_s: float) -> list[Event]:
    """The successions and failures ``service.log`` tells: a succession from its successor's
    submission to the old cell's drain; a failure from the failure to its replacement ready."""
    submitted: dict[str, float] = {}
    follows: dict[str, str] = {}
    failed: dict[str, float] = {}
    events: list[Event] = []
    for line in log.splitlines():
        words = line.split()
        if len(words) < 5 or not line[:4].isdigit():
            continue
        at, what = _log_time(line), words[3:]
        if what[0] == "submitting" and len(what) >= 5:
            submitted[what[1]] = at
            follows[what[1]] = what[-1].rstrip(")")
        elif what[0] == "succession:":
            new, old = what[1], what[3].removesuffix("'s")
            start = submitted.get(new, at)
            events.append(Event(f"succession {old} -> {new}", "succession", start, at + drain_s))
        elif len(what) > 1 and what[1] == "failed:":
            failed[what[0]] = at
        elif len(what) > 2 and what[1:3] == ["is", "ready"]:
            old = follows.get(what[0], "")
            if old in failed:
                label = f"{old} failed -> {what[0]} ready"
                events.append(Event(label, "failure", failed.pop(old), at))
    return events


def measure_events(events: list[Event], requests: list[Request], samples: list[Sample]) -> None:
    """Fill each event's figures from the requests (wall times) and the samples overlapping it.
    A request that overlaps a restart of the front is that restart's only (in flight through the
    killed front, it is lost whatever else happened meanwhile)."""
    fronts = [e for e in events if e.kind == "front"]

    def at_front(r: Request) -> bool:
        return any(r.start <= f.end and r.end >= f.start for f in fronts)

    for e in events:
        during = [r for r in requests if r.start <= e.end and r.end >= e.start]
        if e.kind in ("succession", "failure"):
            during = [r for r in during if not at_front(r)]
        e.requests = len(during)
        e.lost = sum(1 for r in during if r.outcome in ("failed", "cut"))
        e.truncated = sum(1 for r in during if r.outcome == "truncated")
        e.waited = sum(
            1 for r in during if r.first_byte is not None and r.first_byte - r.start > WAITED_S
        )
        inside = [s for s in samples if e.start <= s.at <= e.end]
        e.no_ready_s = SAMPLE_S * sum(1 for s in inside if s.ready == 0)
        e.nodes_max = max((s.live for s in inside), default=0) * NODES_PER_CELL


def judge(events: list[Event]) -> None:
    """Each event's misses against the targets (docs/performance.md)."""
    for e in events:
        if e.kind in ("succession", "failure") and e.lost:
            e.misses.append(f"{e.label}: {e.lost} requests lost (want 0)")
        if e.kind == "succession" and e.no_ready_s:
            e.misses.append(f"{e.label}: {e.no_ready_s:g} s with no ready cell (want 0)")
        if e.nodes_max > MAX_CELLS * NODES_PER_CELL:
            e.misses.append(f"{e.label}: {e.nodes_max} nodes held (at most {MAX_CELLS} cells')")
        if e.kind == "front" and e.end - e.start > FRONT_BACK_S:
            e.misses.append(f"{e.label}: serving again after {e.end - e.start:.1f} s (want 10)")


def _chat(url: str) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def restart_front(serve: ServeProc, url: str) -> Event:
    """SIGKILL the front, start it again; the event lasts until a chat is answered again."""
    start = time.time()
    serve.kill()
    serve.start()
    deadline = time.monotonic() + 60
    while not _chat(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    return Event("front SIGKILLed, restarted", "front", start, time.time())


def _ready(status: dict[str, Any], count: int) -> bool:
    return sum(1 for c in status.get("cells", []) if c["state"] == "ready") >= count


def run(args: argparse.Namespace, root: Path) -> tuple[list[Event], list[Request], list[Sample]]:
    """The service under load with its events; (events, requests, samples)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    starts = root / "prefill-starts"
    sets = service_sets(
        port,
        f"roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S={args.token_delay:g}",
        "slurm.time_limit='3'",
        "service.successor_lead_s=100",
        "service.cells=2",
        "service.drain_s=15",
        "agent.restart.max_restarts=2",
    )
    cluster = cluster_file(root)
    with ServeProc(
        root / "S", ["--cluster", str(cluster), *sets], env=crash_env(starts, env())
    ) as serve:
        serve.wait("two ready cells", lambda s: _ready(s, 2), READY_S)
        print(f"2 cells ready; {args.clients} clients streaming to the service front {url}")
        sampler = Sampler(serve)
        offset = time.time() - time.monotonic()
        load = ChaosLoad(url, MODEL, ANSWER, clients=args.clients).start()
        begun = time.time()
        front: Event | None = None
        try:
            time.sleep(args.crash_at)
            print("crash-looping cell-1's prefill", flush=True)
            crash_loop_prefill(root / "S" / "cells" / "cell-1", starts)
            time.sleep(max(args.restart_at - args.crash_at, 0))
            print("SIGKILL to the service front, then serve again", flush=True)
            front = restart_front(serve, url)
            time.sleep(max(args.duration - (time.time() - begun), 0))
        finally:
            requests = load.finish()
            samples = sampler.finish()
            log = (root / "S" / "service.log").read_text()
            serve.stop(180)
    wall = [_to_wall(r, offset) for r in requests]
    events = log_events(log, 15.0) + ([front] if front else [])
    events.sort(key=lambda e: e.start)
    events.append(Event("whole run", "run", begun, time.time()))
    measure_events(events, wall, samples)
    judge(events)
    return events, wall, samples


def _to_wall(r: Request, offset: float) -> Request:
    first = r.first_byte + offset if r.first_byte is not None else None
    return Request(r.start + offset, r.end + offset, r.outcome, first, r.client_retries, r.error)


def render(events: list[Event], samples: list[Sample], begun: float) -> str:
    """The per-event table, then the nodes held every 10 s."""
    head = (
        f"{'event':34} {'s':>6} {'reqs':>5} {'lost':>5} {'trunc':>5} {'>1s':>4} "
        f"{'no-ready s':>10} {'nodes':>5}"
    )
    lines = [head]
    for e in events:
        lines.append(
            f"{e.label[:34]:34} {e.end - e.start:6.1f} {e.requests:5d} {e.lost:5d} "
            f"{e.truncated:5d} {e.waited:4d} {e.no_ready_s:10.1f} {e.nodes_max:5d}"
        )
    series: list[tuple[float, int]] = []
    for s in samples:
        if not series or s.at - series[-1][0] >= 10:
            series.append((s.at, s.live * NODES_PER_CELL))
    held = " ".join(f"{at - begun:.0f}s:{n}" for at, n in series)
    lines.append(f"\nnodes held (time since the load began: nodes): {held}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tests.bench service``."""
    p = argparse.ArgumentParser(prog="python -m tests.bench service", description=__doc__)
    p.add_argument("--duration", type=float, default=420.0, help="seconds of load (420)")
    p.add_argument("--clients", type=int, default=2, help="streaming clients (2)")
    p.add_argument("--crash-at", type=float, default=40.0, help="the crash-loop, s after start")
    p.add_argument("--restart-at", type=float, default=150.0, help="the front's SIGKILL, s")
    p.add_argument("--token-delay", type=float, default=0.05, help="s per token (a ~2 s chat)")
    p.add_argument("--out", default="bench-service.json", help="the results file")
    return p


def main(argv: list[str]) -> int:
    """Run the service benchmark; 0 when every target is met."""
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tilert-bench-service-") as tmp:
        events, requests, samples = run(args, Path(tmp))
    begun = events[-1].start
    print()
    print(render(events, samples, begun))
    misses = [m for e in events for m in e.misses]
    print(f"\n{len(requests)} requests by {args.clients} clients")
    if misses:
        print("\ntargets missed:")
        for m in misses:
            print(f"  {m}")
    data = {
        "events": [asdict(e) for e in events],
        "requests": [asdict(r) for r in requests],
        "samples": [asdict(s) for s in samples],
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"written to {args.out}")
    return 1 if misses else 0
