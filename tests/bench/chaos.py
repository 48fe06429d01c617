"""``python -m tests.bench chaos [--duration S] [--faults ...] [--clients N] [--set KEY=VALUE]``:
a local 1 prefill + 3 decode mock job (``--local --mock``; TileRT's real router when
``$TILERT_ROUTER_PYTHON`` or ``.cache/router-venv`` has one, else the stand-in, said in the
output) under a steady streaming load (``tests.bench.chaosload``) for a bounded time while, on
a schedule (``tests.bench.chaosplan``), decode engines, the prefill engine, a decode agent and
the router are killed and ``scale`` grows and shrinks the pool (``tests.bench.chaosfaults``).

It prints per fault the requests lost, truncated (visibly), continued by the front after a cut
(``resumed``, from its ``tilert_front_requests_total``) and retried (by the client itself and by
the front, from its ``tilert_front_retries_total``), and the time back to ``ready``; exits 1
naming each target missed (docs/performance.md, "The chaos benchmark"). The clients go to the
job's front door (status.json ``front_url``), or to ``router_url`` when the job has none (or
with ``--target router``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from tests.bench.chaosfaults import Faults, rows, wait_ready
from tests.bench.chaosload import ChaosLoad
from tests.bench.chaosplan import (
    DEFAULT_FAULTS,
    BadFault,
    Schedule,
    Struck,
    account,
    parse_faults,
    render,
)
from tests.bench.procs import env
from tests.kit import FAST, REPO, LocalJob, isolated_sets
from tests.kit.jobdir import read_status
from tests.kit.metrics import samples
from tests.kit.scenarios import ANSWER

READY_TIMEOUT_S = 180.0
# The stand-in decode sleeps this long before each token: a chat streams for about 2 s, so
# every fault finds streams in flight.
TOKEN_DELAY_S = 0.05


def router_python() -> Path | None:
    """TileRT's router: ``$TILERT_ROUTER_PYTHON``, else the checkout's ``.cache/router-venv``."""
    named = os.environ.get("TILERT_ROUTER_PYTHON")
    if named:
        return Path(named)
    cached = REPO / ".cache" / "router-venv" / "bin" / "python"
    return cached if cached.exists() else None


def job_sets(
    python: Path | None, decodes: int, token_delay_s: float, extra: list[str]
) -> list[str]:
    """The job's ``--set`` flags: ports of its own, ``decodes`` decodes, streams paced."""
    args, _ = isolated_sets(
        python,
        *FAST,
        # The real router's /health can take over FAST's 0.5 s while it streams on a loaded machine.
        "agent.probe.timeout_s=5",
        f"roles.decode.nodes={decodes}",
        f"roles.decode.workers={decodes}",
        f"roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S={token_delay_s:g}",
        # The schedule kills the same decode agent round after round: each must rejoin.
        "agent.max_rejoins=1000",
        *extra,
    )
    return args


def front_counters(metrics_url: str | None) -> tuple[float | None, dict[str, float]]:
    """The front's retries (all reasons) and requests by outcome on the head's /metrics; (None,
    {}) without a front."""
    if not metrics_url:
        return None, {}
    try:
        page = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return None, {}
    # A counter with labels shows no sample before its first increment: the page's front
    # families say the front is there.
    retries: float | None = 0.0 if "tilert_front_" in page else None
    outcomes: dict[str, float] = {}
    for s in samples(page):
        if s.name == "tilert_front_retries_total":
            retries = (retries or 0.0) + s.value
        elif s.name == "tilert_front_requests_total":
            key = s.labels.get("outcome", "")
            outcomes[key] = outcomes.get(key, 0.0) + s.value
    return retries, outcomes


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def wait_job_ready(job: LocalJob) -> dict[str, Any]:
    """status.json once the job is ``ready`` (raises when it failed, ended or took too long)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = read_status(job.job)
        if status is not None and status["state"] == "ready":
            return status
        if job.ended() or (status is not None and status["state"] == "failed"):
            raise RuntimeError(f"the job did not come up:\n{job.output()[-3000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"the job was not ready within {READY_TIMEOUT_S:g} s (see {job.job}/logs)")


def _run_faults(
    job: Path, schedule: Schedule, load_start: float, args: argparse.Namespace, metrics: str | None
) -> tuple[list[Struck], Faults]:
    """Strike each fault in turn, waiting for ``ready`` and ``--settle`` seconds after each."""
    faults = Faults(job)
    struck: list[Struck] = []
    try:
        while (fault := schedule.next(time.monotonic() - load_start)) is not None:
            retries, outcomes = front_counters(metrics)
            print(f"  {time.monotonic() - load_start:6.1f} s  {fault.label} ...", flush=True)
            at, check = faults.strike(fault)
            ready_at = wait_ready(job, check, args.bound)
            s = Struck(fault, at, ready_at, retries, outcomes)
            struck.append(s)
            took = "not ready" if ready_at is None else f"ready after {ready_at - at:.1f} s"
            print(f"  {time.monotonic() - load_start:6.1f} s  {fault.label}: {took}", flush=True)
            if ready_at is None:
                break  # the job is not itself again: further faults would measure nothing
            time.sleep(args.settle)
    except BaseException:
        faults.close()
        raise
    return struck, faults


def _front_per_fault(struck: list[Struck], end: tuple[float | None, dict[str, float]]) -> None:
    """Each fault's front figures: the counters' growth from its strike to the next one's."""
    for k, s in enumerate(struck):
        nxt_retries, nxt_outcomes = (
            (struck[k + 1].front_retries, struck[k + 1].front_outcomes)
            if k + 1 < len(struck)
            else end
        )
        if s.front_retries is None or nxt_retries is None:
            s.front_retries = None
            s.front_outcomes = {}
            continue
        s.front_retries = nxt_retries - s.front_retries
        s.front_outcomes = _diff(nxt_outcomes, s.front_outcomes)


def run(args: argparse.Namespace, root: Path) -> int:
    """One chaos run in ``root``; 0 when every target is met."""
    python = router_python()
    which = f"TileRT's router ({python})" if python else "the router stand-in (no router venv)"
    sets = job_sets(python, 3, args.token_delay, args.set)
    root.mkdir(parents=True, exist_ok=True)
    with LocalJob(root / "job", sets, env=env()) as job:
        status = wait_job_ready(job)
        front = status.get("front_url")
        url = front if front and args.target != "router" else status["router_url"]
        target = (
            "the front"
            if url == front
            else "the router (no front_url)"
            if not front
            else ("the router (--target router)")
        )
        metrics = rows(status)["prefill-0"].get("metrics_url") if front else None
        print(f"job ready; {args.clients} clients streaming to {target} {url}; {which}", flush=True)
        load = ChaosLoad(url, status["model"], ANSWER, clients=args.clients).start()
        load_start = time.monotonic()
        faults: Faults | None = None
        try:
            time.sleep(args.settle)
            schedule = Schedule(parse_faults(args.faults), args.duration)
            struck, faults = _run_faults(job.job, schedule, load_start, args, metrics)
            requests = load.finish()
            _front_per_fault(struck, front_counters(metrics))
        finally:
            load.finish()
            if faults is not None:
                faults.close()
            job.stop(60)
    return report(args, requests, struck, which, target, resuming(args, url == front))


def resuming(args: argparse.Namespace, at_front: bool) -> bool:
    """Whether the front continues cut streams: the clients are at it, and no ``--set`` turned
    ``agent.front.resume`` off."""
    off = any(s.replace(" ", "").lower() == "agent.front.resume=false" for s in args.set)
    return at_front and not off


def report(
    args: argparse.Namespace,
    requests: list[Any],
    struck: list[Struck],
    which: str,
    target: str,
    resume: bool = False,
) -> int:
    """Print the per-fault table and the misses, write ``--out``; 1 when a target is missed."""
    costs = account(requests, struck, args.bound, resume=resume)
    load = os.getloadavg()
    print()
    print(render(costs))
    print(f"\n{len(requests)} requests by {args.clients} clients to {target}; {which}")
    print(f"cut streams continued by the front (agent.front.resume): {'yes' if resume else 'no'}")
    print(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    misses = [m for c in costs for m in c.misses]
    for c in costs:
        for e in c.errors[:3]:  # every one is in --out
            print(f"  {c.label}: {e}")
    if misses:
        print("\ntargets missed:")
        for m in misses:
            print(f"  {m}")
    data = {
        "target": target,
        "router": which,
        "load_average": load,
        "options": {k: v for k, v in vars(args).items() if k != "func"},
        "costs": [asdict(c) for c in costs],
        "faults": [
            {"fault": s.fault.label, "at": s.at, "front_outcomes": s.front_outcomes} for s in struck
        ],
        "requests": [asdict(r) for r in requests],
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"written to {args.out}")
    return 1 if misses else 0


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tests.bench chaos``."""
    p = argparse.ArgumentParser(prog="python -m tests.bench chaos", description=__doc__)
    p.add_argument("--duration", type=float, default=210.0, help="seconds of faults (210)")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS), help="the faults, in order")
    p.add_argument("--clients", type=int, default=2, help="concurrent streaming clients (2)")
    p.add_argument("--settle", type=float, default=3.0, help="steady seconds after each fault")
    p.add_argument("--bound", type=float, default=120.0, help="seconds a fault has to heal in")
    p.add_argument("--token-delay", type=float, default=TOKEN_DELAY_S, help="stand-in's pace")
    p.add_argument(
        "--target",
        choices=("auto", "router"),
        default="auto",
        help="auto: the front when the job has one; router: router_url",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the job (repeatable)",
    )
    p.add_argument("--keep", metavar="DIR", help="run the job in DIR and keep it (logs)")
    p.add_argument("--out", default="chaos-results.json", help="the results file to write")
    return p


def _interrupted(_sig: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    """Run the chaos benchmark; its exit code."""
    args = parser().parse_args(argv)
    try:
        parse_faults(args.faults)
    except BadFault as exc:
        print(f"python -m tests.bench chaos: {exc}", file=sys.stderr)
        return 2
    if args.clients < 1 or args.duration <= 0:
        print("python -m tests.bench chaos: --clients and --duration must be > 0", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupted)  # cleaned up as on Ctrl-C
    if args.keep:
        return run(args, Path(args.keep).resolve())
    with tempfile.TemporaryDirectory(prefix="tilert-bench-chaos-") as tmp:
        return run(args, Path(tmp))
