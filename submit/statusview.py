"""``tilert-submit status J [--json]``: the job's state, each agent's, and whether it is stale.

A ``ready`` is only as good as its writer: the head refreshes ``status.json`` at least every 5 s,
so an older ``updated_at``, or a Slurm job that has ended, or a local supervisor that is gone, is
reported as stale instead of being believed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NoReturn

import msgspec

from agent.errors import EXIT_BAD_INPUT
from agent.job.benchmark import BenchmarkStatus
from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan
from agent.job.records import FrontSummary, JobAgent, JobStatus, RouterTokenize
from agent.job.vocab import LIVE_STATES
from agent.problems import printable
from submit.choice import backend_of

# Three missed heartbeats (the head writes every 5 s).
STALE_AFTER_S = 15.0
REASON_WIDTH = 70


class StatusView(msgspec.Struct):
    """``status --json``: status.json plus the submitter's verdict on staleness."""

    status: JobStatus
    stale: bool
    stale_reason: str | None


def _not_a_job(message: str) -> NoReturn:
    """Exit 2 (bad input: the J given) with one line; user paths escaped."""
    print(f"tilert-submit: {printable(message)}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def open_job(path: str) -> JobDir:
    """A job directory named on the command line, or exit 2 saying why it is not one."""
    job = JobDir(Path(path))
    try:
        found = job.status.is_file()
    except OSError as exc:  # a 300-character component, no permission
        _not_a_job(f"{path}: {exc.strerror or exc}; give the folder tilert-submit printed first")
    if not found:
        _not_a_job(
            f"{path} is not a job directory (no status.json); "
            "give the folder tilert-submit printed first"
        )
    return job


def read_status(job: JobDir) -> JobStatus:
    """The job's ``status.json``, or exit 2 when it cannot be read or is not a job status."""
    try:
        return job.read_status()
    except (OSError, msgspec.DecodeError) as exc:  # ValidationError is a DecodeError
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        _not_a_job(
            f"{job.status} is not a usable job status ({reason}); "
            "give the folder tilert-submit printed first"
        )


def read_plan(job: JobDir) -> Plan:
    """The job's ``plan.json``, or exit 2 when it cannot be read or is not a plan."""
    try:
        return load_plan(job.plan.read_bytes())
    except (OSError, msgspec.DecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        _not_a_job(
            f"{job.plan} is not a usable plan ({reason}); re-create the job with tilert-submit"
        )


def staleness(status: JobStatus, now: float | None = None) -> str | None:
    """Why a live-looking state cannot be believed, or None."""
    if status.state not in LIVE_STATES:
        return None
    age = (now or time.time()) - status.updated_at
    backend = backend_of(status)
    if backend is not None and backend.is_running(status) is False:
        return backend.gone(status)
    if age > STALE_AFTER_S:
        return f"status.json not refreshed for {age:.0f}s (the head agent writes it every 5 s)"
    return None


def pool_cell(a: JobAgent) -> str:
    """A decode's place in the pool, since when, and its Slurm job when it has one:
    ``member since 10:02:03 (slurm 4243)``; ``-`` for the prefill and the router."""
    if isinstance(a.pool, msgspec.UnsetType):
        return "-"
    cell: str = a.pool
    if not isinstance(a.pool_since, msgspec.UnsetType):
        cell += " since " + time.strftime("%H:%M:%S", time.localtime(a.pool_since))
    if isinstance(a.slurm_job_id, str):
        cell += f" (slurm {a.slurm_job_id})"
    return cell


def _row(a: JobAgent) -> list[str]:
    endpoints = " ".join(u for u in (a.status_url, a.metrics_url) if u)
    return [a.name, a.node or "-", a.state, pool_cell(a), str(a.restarts), a.reason, endpoints]


def benchmark_line(bench: BenchmarkStatus) -> str:
    """The benchmark's state, its level and why it failed, where its summary is."""
    text = f"benchmark: {bench.state}"
    if bench.state == "running" and bench.level is not None:
        text += f": concurrency {bench.level}"
        if bench.levels_total:
            text += f" (level {bench.levels_done + 1} of {bench.levels_total})"
    elif bench.state == "passed" and bench.levels_total:
        text += f": {bench.levels_done} of {bench.levels_total} levels"
    if bench.error:
        text += f": {bench.error}"
    if bench.summary:
        text += f" (summary: {bench.summary})"
    if bench.state == "pending":
        text += " (runs once the job is ready" + (
            "; the job then keeps serving)" if bench.keep_serving else "; the job ends after it)"
        )
    return text


def front_line(front: FrontSummary) -> str:
    """``front requests: ok 10, retried_ok 2; retries: connect 3; in flight 1; queue: 0 waiting
    (oldest 0.0s), 1/2 at the router``."""
    requests = ", ".join(f"{k} {v}" for k, v in sorted(front.requests.items())) or "none yet"
    text = f"front requests: {requests}"
    if front.retries:
        text += "; retries: " + ", ".join(f"{k} {v}" for k, v in sorted(front.retries.items()))
    text += f"; in flight {front.in_flight}"
    queue = front.queue
    text += (
        f"; queue: {queue.waiting} waiting (oldest {queue.oldest_wait_s:.1f}s), "
        f"{queue.admitted}/{queue.capacity} at the router"
    )
    if queue.refused:
        # "refused", not "429": a ``wait`` with no decode in the router's list is answered 503.
        text += ", refused: " + ", ".join(f"{k} {v}" for k, v in sorted(queue.refused.items()))
    return text


def tokenize_warning(t: RouterTokenize) -> str:
    """The router's tokenization fell back to vLLM's chat path for some chats."""
    state = "on" if t.on else "now OFF"
    return (
        f"warning: the router's own tokenization fell back to vLLM's chat path for "
        f"{t.fallback} of {t.requests} chats ({state}): router.log says why "
        "(tilert-submit logs J router); an extra round trip per chat, answers unchanged"
    )


def render_table(status: JobStatus, stale: str | None) -> str:
    """The human view: a header and one row per agent and the router."""
    lines = [f"job: {status.state}{' (STALE: ' + stale + ')' if stale else ''}"]
    lines.append(f"model: {status.model}")
    lines.append(f"front: {status.front_url or '-'}")
    lines.append(f"router: {status.router_url or '-'}")
    if status.front is not None:
        lines.append(front_line(status.front))
    if status.standins:
        lines.append(f"stand-ins: {', '.join(status.standins)} (--mock)")
    backend = backend_of(status)
    if backend is not None:
        lines.append(backend.summary(status))
    age = time.time() - status.updated_at
    lines.append(f"updated: {age:.1f}s ago")
    if status.error:
        lines.append(f"error: {status.error}")
    if status.router_tokenize is not None and status.router_tokenize.fallback:
        lines.append(tokenize_warning(status.router_tokenize))
    if not isinstance(status.benchmark, msgspec.UnsetType):
        lines.append(benchmark_line(status.benchmark))
    rows = [["NAME", "NODE", "STATE", "POOL", "RESTARTS", "REASON", "ENDPOINTS"]]
    rows += [_row(a) for a in status.agents]
    if status.router is not None:
        rows.append(_row(status.router))
    for r in rows:
        if len(r[5]) > REASON_WIDTH:
            r[5] = r[5][: REASON_WIDTH - 3] + "..."
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines.append("")
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:6], widths, strict=True)]
        lines.append("  ".join([*cells, r[6]]).rstrip())
    lines.extend(progress_lines(status.agents, time.time()))
    lines.extend(trouble_lines([*status.agents, *([status.router] if status.router else [])]))
    rejoined = [a for a in status.agents if a.rejoin_reason]
    if rejoined:
        lines.append("")
        lines += [f"{a.name}: taken back {a.rejoins} time(s); {a.rejoin_reason}" for a in rejoined]
    # What engines, clients and peers said is escaped where it is written; once more here, for
    # a status.json written by another version (every line is ours: no newline inside one).
    return "\n".join(printable(line) for line in lines)


def trouble_lines(agents: list[JobAgent]) -> list[str]:
    """The whole reason of each agent in trouble whose REASON cell was cut (its cause and fix)."""
    out = [
        f"{a.name} {a.state}: {printable(a.reason)}"
        for a in agents
        if a.state in ("failed", "unhealthy", "restarting") and len(a.reason) > REASON_WIDTH
    ]
    return ["", *out] if out else []


def progress_lines(agents: list[JobAgent], now: float) -> list[str]:
    """For each starting engine, its log's last progress line and how long ago it came."""
    out = []
    for a in agents:
        if isinstance(a.progress, str) and isinstance(a.progress_at, float):
            ago = max(0.0, now - a.progress_at)
            out.append(f"{a.name} progress ({_ago(ago)} ago): {printable(a.progress)}")
    return ["", *out] if out else []


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def main(args: argparse.Namespace) -> int:
    """Print the job's status; exit 0 whenever status.json could be read, else 2."""
    status = read_status(open_job(args.job_dir))
    stale = staleness(status)
    if getattr(args, "json", False):
        view = StatusView(status=status, stale=stale is not None, stale_reason=stale)
        print(msgspec.json.encode(view).decode())
    else:
        print(render_table(status, stale))
    return 0
