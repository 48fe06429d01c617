"""Startup deadlines that watch progress: a stand-in that loads slowly and says so outlives its
fixed budget; one that loads as long in silence fails at the budget; a progress bar's last line
is what ``/status`` shows while it loads.

The real prefill stand-in under a real ``EngineSupervisor``: ``TILERT_MOCK_STARTUP_DELAY_S`` keeps
its port closed while it "loads", ``TILERT_MOCK_PROGRESS_EVERY_S`` prints vLLM's shard progress
bar (redrawn with a carriage return, as tqdm does) meanwhile.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import trio

from agent.launch import LaunchSpec, ProcessLauncher
from agent.node.logpump import LogSink
from agent.node.supervisor import EngineSupervisor, Policy
from tests import kit
from tests.infra.ports import free_port
from tests.test_supervisor import policy

PY = sys.executable
LOAD_S = 18.0
BUDGET_S = 8.0  # well above the stand-in's import time, so its first bar comes in time
SILENCE_S = 3.0
WAIT_S = 60.0


def _supervisor(tmp: Path, pol: Policy, **env: str) -> EngineSupervisor:
    port = free_port()
    argv = [PY, "-m", "agent.standins.prefill", "serve", "demo", "--host", "127.0.0.1"]
    full_env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONPATH": str(kit.REPO),
        "PYTHONUNBUFFERED": "1",
        "TILERT_MOCK_STARTUP_DELAY_S": str(LOAD_S),
        **env,  # may set another delay
    }
    return EngineSupervisor(
        name="prefill-0",
        launcher=ProcessLauncher(),
        build=lambda: LaunchSpec(name="prefill-0", argv=[*argv, "--port", str(port)], env=full_env),
        health_url=lambda: f"http://127.0.0.1:{port}/health",
        ports=lambda: {"http": port},
        policy=pol,
        sink=LogSink(tmp / "engine.log", max_bytes=1 << 20, backups=0),
        log=logging.getLogger("test-startup-progress"),
        on_change=lambda: None,
        where="prefill",
    )


async def _until_settled(sup: EngineSupervisor, seen: list[str]) -> None:
    """Run ``sup`` until healthy or failed, noting each progress line ``/status`` shows."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sup.run)
        with trio.fail_after(WAIT_S):
            while sup.state not in ("healthy", "failed"):
                status = sup.status()
                if status.progress and (not seen or seen[-1] != status.progress):
                    seen.append(status.progress)
                await trio.sleep(0.05)
        await sup.stop()


async def test_progress_lines_outlive_the_fixed_budget(tmp_path: Path) -> None:
    pol = policy(startup_budget_s=BUDGET_S, startup_silence_s=SILENCE_S, restart_max=0)
    seen: list[str] = []
    sup = _supervisor(tmp_path, pol, TILERT_MOCK_PROGRESS_EVERY_S="0.5")
    await _until_settled(sup, seen)
    assert sup.stats.time_to_healthy_s is not None, sup.reason
    # Healthy well past the budget it would have been killed at without progress.
    assert sup.stats.time_to_healthy_s > BUDGET_S + 1.0, sup.stats.time_to_healthy_s
    assert sup.restarts == 0
    assert any("Loading safetensors checkpoint shards" in p for p in seen), seen
    # The bar was redrawn in place: /status showed it moving before its line was finished.
    shown = {p.split("|")[1].split("[")[0].strip() for p in seen if "|" in p}
    assert len(shown) >= 3, seen
    # Once healthy, /status shows no progress line.
    assert sup.status().progress is None


async def test_a_silent_load_fails_at_the_budget(tmp_path: Path) -> None:
    pol = policy(startup_budget_s=BUDGET_S, startup_silence_s=SILENCE_S, restart_max=0)
    seen: list[str] = []
    sup = _supervisor(tmp_path, pol)
    t0 = trio.current_time()
    await _until_settled(sup, seen)
    elapsed = trio.current_time() - t0
    assert sup.state == "failed"
    assert sup.stats.time_to_healthy_s is None
    assert "no progress line in its log" in sup.reason, sup.reason
    assert "agent.startup_budget_s" in sup.reason
    assert elapsed < LOAD_S, elapsed  # failed at the budget, before the load would have ended


async def test_progress_too_far_apart_fails_after_the_silence_bound(tmp_path: Path) -> None:
    # A bar every 3 s, a silence bound of 1.5 s: past the budget (long enough for the stand-in to
    # import and print its first bar), the first gap ends the wait, long before the load would.
    pol = policy(startup_budget_s=8.0, startup_silence_s=1.5, restart_max=0)
    env = {"TILERT_MOCK_STARTUP_DELAY_S": "40", "TILERT_MOCK_PROGRESS_EVERY_S": "3"}
    seen: list[str] = []
    sup = _supervisor(tmp_path, pol, **env)
    t0 = trio.current_time()
    await _until_settled(sup, seen)
    assert trio.current_time() - t0 < 30
    assert sup.stats.time_to_healthy_s is None
    assert "no progress line for" in sup.reason, sup.reason
    assert "agent.startup_silence_s" in sup.reason
    assert "Loading safetensors checkpoint shards" in sup.reason
