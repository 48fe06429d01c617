"""The router hand-over under load (docs/cli.md, "Scaling the decode pool"): a local mock job
(``--local --mock``) with TileRT's real router when ``$TILERT_ROUTER_PYTHON`` names one (else the
stand-in, said in the note), 2 clients chatting without pause and retrying a refused connection,
while ``tilert-submit scale`` grows the pool 2 -> 3 and shrinks it 3 -> 2 (two router restarts).

- ``handover_gap_s``: each stretch of refused connections (first refusal -> the start of the
  first chat served after it); the reference is the router's own start in the same job (its
  ``/health`` 200 after launch, from the head's agent.log), which the gap cannot be shorter than;
- ``handover_failed``: requests that failed otherwise (an HTTP error, an error chunk, a stream
  cut): a client that retries a refused connection loses these and nothing else.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from tests.bench.procs import READY_TIMEOUT_S, env, scale, wait_status
from tests.bench.results import Figure
from tests.kit import FAST, LocalJob, isolated_sets
from tests.kit.chatload import ChatLoad

CLIENTS = 2
ROUTER_UP = re.compile(
    r"router: (?:starting|restarting) -> healthy: .* answered 200 after ([\d.]+)s"
)


def _one_round(root: Path, router_python: str | None) -> tuple[list[float], int, list[float]]:
    """(refused stretches, failed requests, the router's own starts) of one grow + shrink."""
    # The real router's /health can take over FAST's 0.5 s while it streams on a loaded machine.
    args, _ = isolated_sets(
        Path(router_python) if router_python else None, *FAST, "agent.probe.timeout_s=5"
    )
    root.mkdir(parents=True, exist_ok=True)
    with LocalJob(root / "job", args, env=env()) as job:
        status = wait_status(job.job, ("ready",), READY_TIMEOUT_S)
        load = ChatLoad(status.router_url or "", status.model, clients=CLIENTS).start()
        try:
            scale(job.job, 3)
            scale(job.job, 2)
        finally:
            load.finish()
            job.stop(60)
        head_log = (job.job / "logs" / "prefill-0" / "agent.log").read_text(errors="replace")
        starts = [float(m) for m in ROUTER_UP.findall(head_log)]
    return load.gaps(), len(load.failures), starts


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """The hand-over figures: one job (quick) or two, each grown and shrunk once under load."""
    router_python = os.environ.get("TILERT_ROUTER_PYTHON")
    which = "TileRT's router" if router_python else "the router stand-in (no TILERT_ROUTER_PYTHON)"
    gaps: list[float] = []
    failed: list[float] = []
    starts: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-handover-") as tmp:
        for i in range(1 if quick else 2):
            g, f, s = _one_round(Path(tmp) / f"round-{i}", router_python)
            gaps += g
            failed.append(float(f))
            starts += s
    note = f"{which}; {CLIENTS} clients retrying refused connections; scale 2 -> 3 -> 2"
    figures = []
    if "handover_gap_s" in names:
        figures.append(
            Figure(
                "handover_gap_s",
                gaps,
                "the router's own start (launch -> /health 200)",
                starts,
                statistic="max",
                note=note,
            )
        )
    if "handover_failed" in names:
        figures.append(Figure("handover_failed", failed, "none", [], statistic="max", note=note))
    return figures
