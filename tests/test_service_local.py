"""``tilert-submit serve --local --mock`` with real processes (docs/service.md): cells whose local
time limit is a minute hand over to their successors while clients stream at the service front
(0 requests lost, the same address); the front SIGKILLed and started again adopts its cells,
serves within 10 s and submits nothing twice; SIGTERM stops every cell and leaves nothing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.bench.chaosload import ChaosLoad
from tests.infra.ports import free_port
from tests.kit.commands import clean_env, submit_cmd
from tests.kit.scenarios import ANSWER
from tests.kit.service import (
    ServeProc,
    cluster_file,
    crash_env,
    crash_loop_prefill,
    nothing_left,
    service_sets,
)
from tests.kit.waiting import wait_for

# A cell loads in seconds here; two successions take about a minute.
READY_S = 120.0
SUCCESSIONS_S = 240.0
ADOPT_S = 10.0
MODEL = "demo-model"


def ready_cells(status: dict[str, Any]) -> list[str]:
    return [c["name"] for c in status.get("cells", []) if c["state"] == "ready"]


def chat(url: str) -> bool:
    """One short chat at the front: whether it was answered 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def assert_submitted_once(status: dict[str, Any]) -> None:
    """One initial cell, and no cell succeeded or replaced twice."""
    cells = status["cells"]
    assert [c["name"] for c in cells if c["reason"] == "initial"] == ["cell-1"], cells
    follows = Counter(c["follows"] for c in cells if c["follows"])
    assert all(n == 1 for n in follows.values()), follows


def test_successions_lose_nothing_and_a_restarted_front_adopts_its_cells(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = cluster_file(tmp_path)
    sets = service_sets(port, "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05")
    with ServeProc(tmp_path / "S", ["--cluster", str(cluster), *sets]) as serve:
        serve.wait("a ready cell", ready_cells, READY_S)
        load = ChaosLoad(url, MODEL, ANSWER, clients=2).start()
        try:
            serve.wait("two successions", lambda s: s["successions"] >= 2, SUCCESSIONS_S)
        finally:
            requests = load.finish()
        lost = [r for r in requests if r.outcome != "ok"]
        assert len(requests) > 10, requests
        assert not lost, lost[:5]
        before = serve.service()
        assert_submitted_once(before)

        serve.kill()
        serve.start()
        # The bound of the wait, not a measure: the service benchmark measures the time back.
        wait_for("the restarted front to serve", lambda: chat(url) or None, ADOPT_S + 5)
        after = serve.wait("the front's new pid", lambda s: s["front_pid"] == serve.proc.pid, 10)
        live = {c["name"]: c for c in before["cells"] if c["state"] in ("ready", "starting")}
        kept = {c["name"]: c for c in after["cells"]}
        for name, cell in live.items():
            assert kept[name]["local_pid"] == cell["local_pid"], (name, kept[name])
        assert "adopted cells" in (tmp_path / "S" / "service.log").read_text()
        assert_submitted_once(after)
        assert after["requests"]["ok"] >= before["requests"]["ok"]

        assert serve.stop(180) == 0, serve.output()
        final = json.loads((tmp_path / "S" / "service.json").read_text())
        assert final["state"] == "stopped"
        assert {c["state"] for c in final["cells"]} <= {"ended", "failed"}, final["cells"]
        assert not nothing_left(serve, 10)
        assert not (tmp_path / "S" / "front.lock").exists()


def test_a_second_front_on_the_same_service_refuses(tmp_path: Path) -> None:
    port = free_port()
    cluster = cluster_file(tmp_path)
    sets = service_sets(port, "slurm.time_limit='10'")
    with ServeProc(tmp_path / "S", ["--cluster", str(cluster), *sets]) as serve:
        serve.wait("a ready cell", ready_cells, READY_S)
        serve.start()
        second = serve.proc
        assert second.wait(60) == 1
        out = serve.output()
        assert "another service front" in out, out
        assert f"pid {serve.fronts[0].pid}" in out, out
        assert serve.fronts[0].poll() is None
        assert ready_cells(serve.service())
        serve.fronts.pop()  # the first front is the one to stop
        assert serve.stop(120) == 0


def test_a_cell_whose_prefill_crash_loops_is_replaced_while_the_other_serves(
    tmp_path: Path,
) -> None:
    """Two cells; cell-1's prefill crash-loops until its head fails the job: cell-1 leaves the
    routing (its streams cut, marked), a replacement follows it after the backoff, cell-2 serves
    throughout; no request is lost (a stream cut on cell-1 ends with stream_truncated)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = cluster_file(tmp_path)
    starts = tmp_path / "prefill-starts"
    env = crash_env(starts, clean_env())
    sets = service_sets(
        port,
        "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05",
        "slurm.time_limit='10'",  # no succession in this test
        "service.successor_lead_s=60",
        "service.cells=2",
        "agent.restart.max_restarts=2",
    )
    with ServeProc(tmp_path / "S", ["--cluster", str(cluster), *sets], env=env) as serve:
        serve.wait("two ready cells", lambda s: len(ready_cells(s)) == 2, READY_S)
        load = ChaosLoad(url, MODEL, ANSWER, clients=2).start()
        try:
            # Chats answered, so streams run at both cells when the prefill starts to crash.
            wait_for("chats answered", lambda: len(load.requests) >= 4 or None, 60)
            crash_loop_prefill(tmp_path / "S" / "cells" / "cell-1", starts)
            failed = serve.wait(
                "cell-1 failed", lambda s: s["cells"][0]["state"] == "failed", READY_S
            )
            assert "cell-2" in ready_cells(failed), failed["cells"]
            replaced = serve.wait(
                "its replacement ready",
                lambda s: any(
                    c["follows"] == "cell-1" and c["state"] == "ready" for c in s["cells"]
                ),
                READY_S,
            )
        finally:
            requests = load.finish()
        cells = {c["name"]: c for c in replaced["cells"]}
        assert cells["cell-1"]["detail"], cells["cell-1"]
        assert cells["cell-3"]["reason"] == "replacement", cells
        assert cells["cell-2"]["state"] == "ready", cells
        assert replaced["replacements"] == 1
        outcomes = Counter(r.outcome for r in requests)
        assert set(outcomes) <= {"ok", "truncated"}, [r for r in requests if r.outcome != "ok"]
        assert outcomes["ok"] > 10, outcomes
        # `stop S` signals the front (proven by its pid and start time), which stops every cell.
        stopped = submit_cmd("stop", str(tmp_path / "S"), timeout=200)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert serve.proc.wait(30) == 0, serve.output()
        assert serve.service()["state"] == "stopped"
        assert not nothing_left(serve, 10)
