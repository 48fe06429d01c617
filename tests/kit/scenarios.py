"""Scenarios the local and the Slurm end-to-end tests share, as checks on a job directory.

Each ``check_*`` takes the job directory of a running (or just ended) demo job and asserts what
users must see; the fault overrides are the ``--set`` values that make a fault, next to the check
for what the job must show then.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from tests.kit.endpoints import (
    agent_status,
    chat,
    chat_concurrently,
    metric_value,
    router_serves_without,
)
from tests.kit.jobdir import agent_entry, current_status, record, wait_state, wait_status
from tests.kit.processes import assert_nothing_left

AGENT_FIELDS = {
    "name",
    "role",
    "index",
    "node",
    "state",
    "restarts",
    "reason",
    "log",
    "metrics_url",
    "status_url",
}
AGENTS = ("prefill-0", "decode-0", "decode-1")
# What the stand-ins generate (docs/standins.md): the prefill's "H", then the decode's text.
ANSWER = "Hello from the TileRT decode stand-in."
MODEL = "demo-model"


def check_ready_contract(job: Path) -> dict[str, Any]:
    """Ready per docs/agent.md: status.json's fields, every agent healthy, targets.json naming each
    agent's metrics address with only the ``agent`` label, the real router; the status."""
    status = current_status(job)
    assert status["state"] == "ready", status
    assert status["error"] is None, status
    assert status["router_url"].startswith("http://127.0.0.1:")
    assert status["model"] == MODEL
    names = [a["name"] for a in status["agents"]]
    assert names == list(AGENTS), names
    for entry in status["agents"]:
        assert set(entry) >= AGENT_FIELDS, entry
        assert entry["state"] == "healthy", entry
        assert entry["node"]
        assert entry["status_url"]
        assert entry["metrics_url"]
        assert Path(entry["log"]).is_file(), entry
    targets = json.loads((job / "prometheus" / "targets.json").read_text())
    assert sorted(t["labels"]["agent"] for t in targets) == sorted(names), targets
    by_agent = {t["labels"]["agent"]: t for t in targets}
    for entry in status["agents"]:
        target = by_agent[entry["name"]]
        # No role/node/slurm_job_id; the head's names the front door (the job's client address).
        front = {"front_url": status["front_url"]} if entry["name"] == "prefill-0" else {}
        assert target["labels"] == {"agent": entry["name"], **front}, target
        assert target["targets"] == [entry["metrics_url"].split("//")[1].split("/")[0]]
    # The real router, not the stand-in.
    router_log = (job / "logs" / "prefill-0" / "router.log").read_text()
    assert "tilert.pd_vllm.pd_router" in router_log.splitlines()[0]
    assert "agent.standins.router" not in router_log
    assert "using the router stand-in" not in (job / "logs/prefill-0/agent.log").read_text()
    return status


def check_chat(job: Path) -> None:
    """A streamed chat through router_url returns the stand-ins' text; two at once too."""
    router_url = current_status(job)["router_url"]
    text = chat(router_url, MODEL)
    assert text == ANSWER, text
    texts = chat_concurrently(router_url, MODEL, 2)
    assert texts == [ANSWER] * 2, texts


def check_gate_latency(job: Path, where: str) -> None:
    """The head logs the gate latency and exports it; printed, bounded only by the budget."""
    log = (job / "logs" / "prefill-0" / "agent.log").read_text()
    line = next(x for x in log.splitlines() if "router started" in x)
    prefill = agent_entry(current_status(job), "prefill-0")
    gate = metric_value(prefill["metrics_url"], "tilert_agent_gate_latency_seconds")
    print(f"\n{where} gate latency: metric {gate} s; log: {line.split('head: ', 1)[-1]}")
    assert gate is not None
    assert 0 <= gate < 60


def check_engine_sigkill_recovers(job: Path) -> None:
    """SIGKILL decode-0's engine: same ports, degraded then ready, the router not restarted."""
    status = current_status(job)
    d0 = agent_entry(status, "decode-0")
    before = agent_status(d0["status_url"])
    record_before = record(job, "decode-0")
    head = agent_status(agent_entry(status, "prefill-0")["status_url"])
    router_pid, router_restarts = head["router"]["pid"], head["router"]["restarts"]
    assert before["state"] == "healthy"
    assert before["pid"]
    assert psutil.Process(before["pid"]).cmdline()[2] == "agent.standins.decode"

    seen: list[str] = []
    psutil.Process(before["pid"]).send_signal(signal.SIGKILL)
    wait_state(job, "degraded", 15, seen=seen)
    after_status = wait_state(job, "ready", 30, seen=seen)
    print(f"\nstates after the SIGKILL: {seen}")

    after = agent_status(d0["status_url"])
    assert after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1
    assert after["ports"] == before["ports"]
    assert record(job, "decode-0")["ports"] == record_before["ports"]
    assert agent_entry(after_status, "decode-0")["restarts"] == after["restarts"]
    head = agent_status(agent_entry(after_status, "prefill-0")["status_url"])
    assert head["router"]["pid"] == router_pid
    assert head["router"]["restarts"] == router_restarts == 0
    texts = chat_concurrently(after_status["router_url"], MODEL, 2)
    assert texts == [ANSWER] * 2, texts


def check_stopped(
    job: Path, status: dict[str, Any], cmd: Callable[..., subprocess.CompletedProcess[str]]
) -> dict[str, Any]:
    """A stopped job: ``stopped`` without router_url; ``stop`` again is fine (``cmd`` runs
    tilert-submit); a "ready" left behind reads as STALE. The ``status --json`` view."""
    assert status["state"] == "stopped", status
    assert status["router_url"] is None
    assert cmd("stop", str(job)).returncode == 0
    (job / "status.json").write_text(json.dumps(dict(status, state="ready")))
    done = cmd("status", str(job), "--json")
    assert done.returncode == 0, done.stderr
    view: dict[str, Any] = json.loads(done.stdout)
    assert view["stale"] is True, view
    assert "STALE" in cmd("status", str(job)).stdout
    return view


# Faults: the recipe overrides and what the job must show.
DECODE_CRASH_LOOP = (
    "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
    "roles.decode.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
    "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 2, window_s: 60}",
)
PREFILL_CRASH_LOOP = (
    "roles.prefill.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
    "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 1, window_s: 60}",
)
DECODES_NEVER_HEALTHY = (
    # Bound and hanging (not a startup delay, whose unbound ports another job could take).
    # Only the decodes get the small budget: a loaded machine may take more than 3 s to start
    # the prefill stand-in, and the test is about the decodes.
    "roles.decode.env.TILERT_MOCK_HANG_HEALTH=1",
    "agent.startup_budget_s={prefill: 120, decode: 3, router: 120}",
    # The stand-in's startup lines ("TileRT engine ready", "control plane listening") count as
    # progress, which would move the decodes' deadline by the default 900 s of silence.
    "agent.startup_silence_s=1",
)


def check_decode_dropped(job: Path, timeout: float) -> dict[str, Any]:
    """decode-1 crash-looping: dropped (failed, its log named), the job degraded and the router
    serving without it through decode-0; the status."""
    status = wait_status(
        job,
        lambda s: (
            s["state"] == "degraded"
            and agent_entry(s, "decode-1")["state"] == "failed"
            and "dropped" in agent_entry(s, "decode-1")["reason"]
            and s["router_url"] is not None
            and router_serves_without(job, s, "decode-1")
        ),
        "degraded with decode-1 dropped and the router healthy without it",
        timeout,
    )
    d1 = agent_entry(status, "decode-1")
    assert d1["log"].endswith("logs/decode-1/engine.log"), d1
    assert Path(d1["log"]).is_file(), d1
    assert "gave up" in d1["reason"], d1
    assert "restart" in d1["reason"] or "exited" in d1["reason"], d1
    assert agent_entry(status, "decode-0")["state"] == "healthy"
    assert chat(status["router_url"], MODEL) == ANSWER
    return status


def check_prefill_failed(job: Path, status: dict[str, Any]) -> None:
    """The prefill crash-looping: failed naming prefill-0 and its log; its agent exited 1 and
    nothing of the job is left."""
    assert status["state"] == "failed", status
    assert "prefill-0" in status["error"], status["error"]
    assert "logs/prefill-0/engine.log" in status["error"], status["error"]
    assert agent_entry(status, "prefill-0")["state"] == "failed"
    assert "exiting with code 1" in (job / "logs/prefill-0/agent.log").read_text()
    assert_nothing_left(job, 10)


def check_decodes_never_healthy(job: Path, status: dict[str, Any]) -> None:
    """Decodes that never answer within the startup budget: failed naming each and its log;
    nothing of the job is left."""
    assert status["state"] == "failed", status
    for name in ("decode-0", "decode-1"):
        assert name in status["error"], status["error"]
        assert f"logs/{name}/engine.log" in status["error"], status["error"]
    assert "startup" in status["error"], status["error"]
    assert_nothing_left(job, 10)
