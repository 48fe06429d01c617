"""``tilert-submit serve`` on the real local Slurm with TileRT's real router and the stand-in
engines (docs/service.md), in ONE service run of two cells (Slurm jobs) with a five-minute time
limit, checked step by step:

1. the front SIGKILLed and started again adopts its cells (the same job ids), serves again, and
   submits nothing twice (every Slurm job is a cell of ``service.json``; no cell followed twice);
2. cell-1's prefill crash-loops: cell-1 fails, a replacement follows it while cell-2 serves
   (streams cut on cell-1 end marked ``truncated``; nothing else lost);
3. clients stream at the same front address through two successions: 0 requests lost;
4. ``tilert-submit stop S`` leaves no job in ``squeue`` and no process."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests import kit
from tests.bench.chaosload import ChaosLoad
from tests.bench.chaosplan import Request
from tests.infra.ports import free_port
from tests.infra.slurm import LocalSlurm
from tests.kit.commands import submit_cmd
from tests.kit.scenarios import ANSWER
from tests.kit.service import (
    MODEL,
    ServeProc,
    assert_submitted_once,
    chat,
    crash_env,
    crash_loop_prefill,
    nothing_left,
    ready_cells,
)
from tests.kit.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.router]

READY_S = 150.0  # sbatch, two srun steps, the real router's imports, on 2 shared cores
# A cell's successor is submitted 150 s before its end (150 s after its start): the first two
# steps fit before; two successions then need about a cell's life.
SUCCESSIONS_S = 420.0
ADOPT_S = 10.0
SIGNAL_LEAD_S = 20
LIVE = ("submitted", "starting", "ready", "retiring")


def slurm_jobs(slurm: LocalSlurm, first: str) -> set[str]:
    """Every job Slurm knows (running or ended in the last 10 minutes: MinJobAge) from ``first``
    on: the service's (the ``slurm`` fixture runs one test at a time)."""
    out = slurm.run(["squeue", "-h", "--states=all", "-o", "%i"]).stdout.split()
    return {j for j in out if j.isdigit() and int(j) >= int(first)}


def cell_jobs(status: dict[str, Any]) -> set[str]:
    return {c["slurm_job_id"] for c in status["cells"] if c["slurm_job_id"]}


def by_name(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in status["cells"]}


def restart_adopts(serve: ServeProc, slurm: LocalSlurm, url: str, first: str) -> None:
    """Step 1: SIGKILL the front, start it again: it serves within the bound through the same
    cells and submits nothing twice (a cell submitted meanwhile is a due successor, recorded)."""
    before = serve.service()
    assert slurm_jobs(slurm, first) == cell_jobs(before), (slurm.squeue(), before["cells"])
    serve.kill()
    serve.start()
    # The bound of the wait, not a measure: the service benchmark measures the time back.
    wait_for("the restarted front to serve", lambda: chat(url) or None, ADOPT_S + 5)
    after = serve.wait("the front's new pid", lambda s: s["front_pid"] == serve.proc.pid, 10)
    assert after["front_url"] == before["front_url"], (before["front_url"], after["front_url"])
    kept = by_name(after)
    for name, cell in by_name(before).items():
        assert kept[name]["slurm_job_id"] == cell["slurm_job_id"], (name, kept[name])
    new = [c for c in after["cells"] if c["name"] not in by_name(before)]
    assert all(c["reason"] == "successor" for c in new), f"submitted on restart: {new}"
    assert slurm_jobs(slurm, first) == cell_jobs(after), (slurm.squeue(), after["cells"])
    assert_submitted_once(after, lines=2)
    assert "adopted cells" in (serve.sdir / "service.log").read_text()


def crash_is_replaced(serve: ServeProc, url: str, starts: Path) -> None:
    """Step 2: cell-1's prefill crash-loops until its head fails the job; a replacement follows
    it while cell-2 serves; the streams are all answered but those cut on cell-1 (marked)."""
    load = ChaosLoad(url, MODEL, ANSWER, clients=2).start()
    try:
        wait_for("chats answered", lambda: len(load.requests) >= 4 or None, 60)
        crash_loop_prefill(serve.sdir / "cells" / "cell-1", starts)
        failed = serve.wait("cell-1 failed", lambda s: s["cells"][0]["state"] == "failed", 120)
        assert "cell-2" in ready_cells(failed), f"cell-2 not serving meanwhile: {failed['cells']}"
        replaced = serve.wait(
            "cell-1's replacement ready",
            lambda s: any(
                c["follows"] == "cell-1" and c["reason"] == "replacement" and c["state"] == "ready"
                for c in s["cells"]
            ),
            READY_S,
        )
    finally:
        requests = load.finish()
    assert by_name(replaced)["cell-1"]["detail"], by_name(replaced)["cell-1"]
    assert replaced["replacements"] == 1, replaced
    outcomes = Counter(r.outcome for r in requests)
    assert set(outcomes) <= {"ok", "truncated"}, [r for r in requests if r.outcome != "ok"][:5]
    assert outcomes["ok"] > 4, outcomes


def streams_through_two_successions(serve: ServeProc, url: str) -> list[Request]:
    """Step 3: streaming clients at the same address while two successions happen: 0 lost."""
    start = serve.service()["successions"]
    load = ChaosLoad(url, MODEL, ANSWER, clients=2).start()
    try:
        done = serve.wait("two successions", lambda s: s["successions"] >= start + 2, SUCCESSIONS_S)
    finally:
        requests = load.finish()
    lost = [r for r in requests if r.outcome != "ok"]
    assert len(requests) > 10, requests
    assert not lost, f"{len(lost)} of {len(requests)} lost: {lost[:5]}"
    successors = [c for c in done["cells"] if c["reason"] == "successor"]
    assert len(successors) >= 2, done["cells"]
    assert_submitted_once(done, lines=2)
    return requests


def test_a_slurm_service_adopts_replaces_succeeds_twice_and_stops_clean(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    cluster = slurm_cluster_file
    cluster.write_text(cluster.read_text() + f"signal_lead_s: {SIGNAL_LEAD_S}\n")
    port = free_port()
    starts = tmp_path / "prefill-starts"
    sets, _ = kit.isolated_sets(
        router_python,
        "roles.decode.nodes=1",
        "roles.decode.workers=1",
        "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05",
        "service.cells=2",
        # Room for both lines' successors and a replacement at once (3 nodes of 4 CPUs).
        "service.max_cells=4",
        # Five minutes; a successor 150 s before the end: 150 s after the start, 110 s before
        # the earliest TERM (the lead, or up to 60 s before it).
        "slurm.time_limit='5'",
        "service.successor_lead_s=150",
        "service.drain_s=15",
        "service.replace.backoff_s=1",
        "agent.restart.max_restarts=2",
        f"service.front.port={port}",
    )
    url = f"http://127.0.0.1:{port}"
    args = ["--cluster", str(cluster), *sets]
    env = crash_env(starts, slurm.env)
    with ServeProc(tmp_path / "S", args, env=env, local=False) as serve:
        first = serve.wait("two ready cells", lambda s: len(ready_cells(s)) == 2, READY_S)
        first_job = min(cell_jobs(first), key=int)
        restart_adopts(serve, slurm, url, first_job)
        crash_is_replaced(serve, url, starts)
        streams_through_two_successions(serve, url)

        live = [c["slurm_job_id"] for c in serve.service()["cells"] if c["state"] in LIVE]
        stopped = submit_cmd("stop", str(serve.sdir), env=slurm.env, timeout=240)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert serve.proc.wait(60) == 0, serve.output()
        final = serve.service()
        assert final["state"] == "stopped", final
        assert {c["state"] for c in final["cells"]} <= {"ended", "failed"}, final["cells"]
        wait_for("no job in squeue", lambda: not slurm.squeue(), slurm.kill_wait_s + 30)
        assert not nothing_left(serve, 10)
        assert slurm_jobs(slurm, first_job) == cell_jobs(final), "a job no cell records"
        # The front itself stopped every live cell (`stop S` only sweeps what a front left),
        # saying so in its log, not on serve's stdout.
        log = (serve.sdir / "service.log").read_text()
        unsaid = [j for j in live if f"stopping Slurm job {j}:" not in log]
        assert not unsaid, f"live cells' jobs the front did not stop: {unsaid}\n{log[-3000:]}"
