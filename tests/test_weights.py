"""Weights converted once, under a lock, atomically, before anyone serves them (docs/weights.md).

Real ``tilert-agent`` processes and local jobs (tests/kit: ``AgentProc``, ``LocalJob``) with the
converter stand-in (``agent.standins.converter``), its switches set through
``--set roles.decode.env.TILERT_MOCK_CONVERT_...`` or the agent's environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.node.weightsfolder import MARKER_NAME, inspect
from tests.conftest import require
from tests.kit import (
    AgentProc,
    Agents,
    LocalJob,
    agent_entry,
    command_lines,
    isolated_sets,
    make_job,
    running_agents,
    wait_for,
    wait_state,
    wait_status,
)
from tests.kit.checkpoint import checkpoint

# Seconds per shard: a conversion of 4 shards takes about 5 s (with the MTP shard), 2 s to the
# second shard. The other agent must find the lock held, however late a loaded machine starts it
# (at 0.25 s a shard, one second late found the conversion over, or failed, and never waited).
SLOW = "1.0"


@pytest.fixture
def agents() -> Iterator[Agents]:
    """Agents of one test, killed (with their converters and engines) afterwards."""
    with running_agents() as started:
        yield started


def weights_job(root: Path, weights: Path, *sets: str, convert: bool = True) -> Path:
    """A demo job whose decodes serve ``weights``, converted from ``root/hf`` when ``convert``."""
    extra = [f"roles.decode.args.model-weights-dir={weights}"]
    if convert:
        extra.append(f"roles.decode.convert={{source: {checkpoint(root.parent / 'hf')}}}")
    return make_job(root, *extra, *sets)


def conversions(*jobs: Path) -> list[str]:
    """Every converter run of these jobs (one ``=== converter pid`` line each)."""
    runs = []
    for job in jobs:
        for log in sorted((job / "logs").glob("*/convert.log")):
            lines = log.read_text(errors="replace").splitlines()
            runs += [f"{log.parent.name}: {x}" for x in lines if x.startswith("=== converter pid")]
    return [r for r in runs if "ended" not in r]


def siblings(weights: Path) -> list[str]:
    """What the agent left beside the folder (locks, conversions, moved-aside folders)."""
    return sorted(
        p.name for p in weights.parent.iterdir() if p.name.startswith(f".{weights.name}.")
    )


def agent_log(agent: AgentProc) -> str:
    return agent.agent_log.read_text(errors="replace")


def converters_of(root: Path) -> list[psutil.Process]:
    """Live converter stand-ins writing under ``root``."""
    return [
        proc
        for proc, cmd in command_lines()
        if "agent.standins.converter" in cmd and str(root) in cmd
    ]


def test_two_decode_agents_racing_on_one_folder_convert_it_once(
    tmp_path: Path, agents: Agents
) -> None:
    weights = tmp_path / "shared" / "glm5"
    job = weights_job(
        tmp_path / "a", weights, f"roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S={SLOW}"
    )
    both = [agents.start(job, "decode", 0), agents.start(job, "decode", 1)]
    waiter: dict[str, Any] = {}

    def one_waits() -> bool:
        for agent in both:
            status = agent.status()
            convert = status.get("convert")
            if status["state"] == "converting" and convert and convert["role"] == "waiting":
                waiter.update(status)
                return True
        return False

    wait_for("one agent waiting for the other's conversion", one_waits, 20)
    holder = waiter["convert"]["holder"]
    assert holder != waiter["name"]
    assert holder in ("decode-0", "decode-1")
    assert waiter["convert"]["holder_node"]
    assert waiter["convert"]["holder_job"] == str(job)
    assert f"waiting for {holder} on " in waiter["reason"]
    for agent in both:
        agent.wait_state("healthy", timeout=30)
    assert len(conversions(job)) == 1, conversions(job)
    assert conversions(job)[0].startswith(holder)
    found = inspect(weights)
    assert found.complete, found.problems
    assert found.marker is not None, found.problems
    assert found.marker.agent == holder
    assert found.marker.job == str(job)
    assert siblings(weights) == []  # no lock, no conversion folder left


def test_a_hub_id_source_is_converted_from_the_decodes_hugging_face_cache(
    tmp_path: Path, agents: Agents
) -> None:
    """``source: hf:org/name`` (schema 1's hf: model): the snapshot refs/main names in the
    decode's HF_HUB_CACHE, as srtctl's snapshot_download(local_files_only=True)."""
    weights = tmp_path / "shared" / "glm5"
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snap = checkpoint(repo / "snapshots" / "r1")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("r1")
    job = make_job(
        tmp_path / "a",
        f"roles.decode.args.model-weights-dir={weights}",
        "roles.decode.convert={source: 'hf:org/tiny'}",
        f"roles.decode.env.HF_HUB_CACHE={cache}",
    )
    agent = agents.start(job, "decode", 0)
    agent.wait_state("healthy", timeout=30)
    found = inspect(weights)
    assert found.marker is not None, found.problems
    assert found.marker.source == str(snap)
    # Not in the cache: the decode fails at once, saying where it looked and how to get it.
    other = make_job(
        tmp_path / "b",
        f"roles.decode.args.model-weights-dir={tmp_path / 'other' / 'w'}",
        "roles.decode.convert={source: 'hf:org/missing'}",
        f"roles.decode.env.HF_HUB_CACHE={cache}",
    )
    failed = agents.start(other, "decode", 0).wait_state("failed", timeout=30)
    assert f"org/missing is not in the Hugging Face cache {cache}" in failed["reason"], failed
    assert "huggingface-cli download org/missing" in failed["reason"]


def test_a_failed_conversion_is_known_at_once_by_the_decode_waiting_for_it(
    tmp_path: Path, agents: Agents
) -> None:
    """The converter exits 1 half way: the holder leaves its verdict in the lock before letting
    go, so the waiter fails with the holder's reason at its next polls, long before the
    convert_lock_stale_s / 2 (here the default 120 s: 60 s) a vanished lock alone would cost."""
    weights = tmp_path / "shared" / "glm5"
    job = weights_job(
        tmp_path / "a",
        weights,
        f"roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S={SLOW}",
        "roles.decode.env.TILERT_MOCK_CONVERT_CRASH_AFTER_SHARDS=2",
    )
    both = [agents.start(job, "decode", 0), agents.start(job, "decode", 1)]
    waiting: list[AgentProc] = []

    def one_waits() -> bool:
        for agent in both:
            convert = agent.status().get("convert") or {}
            if convert.get("role") == "waiting":
                waiting.append(agent)
                return True
        return False

    wait_for("one agent waiting for the other's conversion", one_waits, 20)
    (waiter,) = waiting
    (holder,) = [a for a in both if a is not waiter]
    failed = holder.wait_state("failed", timeout=30)
    assert "exited with code 1" in failed["reason"], failed
    # Bounded well below the 60 s of the fallback, with room for a slow machine.
    other = waiter.wait_state("failed", timeout=20)
    assert "ended without completing it: the converter exited with code 1" in other["reason"]
    assert f"decode-{holder.index}" in other["reason"], other
    assert not inspect(weights).complete
    wait_for("the lock gone", lambda: siblings(weights) == [], 10)


def test_sigkilled_conversion_leaves_nothing_complete_and_the_next_job_takes_over(
    tmp_path: Path, agents: Agents
) -> None:
    weights = tmp_path / "shared" / "glm5"
    slow = "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=0.5"
    first = weights_job(
        tmp_path / "a", weights, slow, "roles.decode.env.TILERT_MOCK_CONVERT_SHARDS=8"
    )
    holder = agents.start(first, "decode", 0)
    holder.wait_status(
        "converting with a shard written",
        lambda s: (
            s["state"] == "converting" and (s.get("convert") or {}).get("bytes_written", 0) > 0
        ),
        timeout=30,
    )
    holder.kill()  # SIGKILL the agent: its lifeline SIGKILLs the converter
    wait_for("the converter to be gone", lambda: not converters_of(tmp_path), 10)
    assert not inspect(weights).complete
    assert not (weights / MARKER_NAME).exists()
    left = siblings(weights)
    assert f".{weights.name}.tilert-lock" in left, left  # the stale lock
    assert any("tilert-converting-" in name for name in left), left  # the dead conversion

    second = weights_job(tmp_path / "b", weights, "agent.convert_lock_stale_s=1")
    taker = agents.start(second, "decode", 0)
    status = taker.wait_status(
        "waiting for the dead holder",
        lambda s: s["state"] == "converting" and (s.get("convert") or {}).get("role") == "waiting",
        timeout=20,
    )
    assert status["convert"]["holder_job"] == str(first)
    taker.wait_state("healthy", timeout=30)
    log = agent_log(taker)
    assert "taking it over" in log
    assert "left by a conversion that died" in log
    assert len(conversions(second)) == 1
    found = inspect(weights)
    assert found.complete
    assert found.marker is not None
    assert found.marker.job == str(second)
    assert siblings(weights) == []


def test_a_complete_folder_is_never_converted_again(tmp_path: Path, agents: Agents) -> None:
    weights = tmp_path / "shared" / "glm5"
    first = weights_job(tmp_path / "a", weights)
    agents.start(first, "decode", 0).wait_state("healthy", timeout=30)
    marker = (weights / MARKER_NAME).read_bytes()
    # A second job, also asked to convert, and even with a converter that would fail.
    second = weights_job(
        tmp_path / "b", weights, "roles.decode.env.TILERT_MOCK_CONVERT_CRASH_AFTER_SHARDS=1"
    )
    again = agents.start(second, "decode", 0)
    again.wait_state("healthy", timeout=30)
    assert conversions(second) == []
    assert not (second / "logs" / "decode-0" / "convert.log").exists()
    assert f"weights {weights} complete" in agent_log(again)
    assert (weights / MARKER_NAME).read_bytes() == marker


def test_a_folder_missing_a_shard_is_refused_before_the_engine_starts(
    tmp_path: Path, agents: Agents
) -> None:
    weights = tmp_path / "shared" / "glm5"
    agents.start(weights_job(tmp_path / "a", weights), "decode", 0).wait_state("healthy", 30)
    shard = sorted(weights.glob("model.safetensors-*"))[1]
    shard.unlink()
    job = weights_job(tmp_path / "b", weights, convert=False)
    agent = agents.start(job, "decode", 0)
    status = agent.wait_state("failed", timeout=20)
    reason = status["reason"]
    assert shard.name in reason, reason
    assert "missing" in reason, reason
    assert "roles.decode.convert" in reason, reason
    assert "tilert-submit convert" in reason, reason
    assert not (job / "logs" / "decode-0" / "engine.log").exists()  # no engine was started
    assert status["pid"] is None


def test_an_incomplete_folder_with_convert_is_replaced(tmp_path: Path, agents: Agents) -> None:
    weights = tmp_path / "shared" / "glm5"
    agents.start(weights_job(tmp_path / "a", weights), "decode", 0).wait_state("healthy", 30)
    sorted(weights.glob("model.safetensors-*"))[0].unlink()
    job = weights_job(tmp_path / "b", weights)
    agents.start(job, "decode", 0).wait_state("healthy", timeout=30)
    assert len(conversions(job)) == 1
    found = inspect(weights)
    assert found.complete
    assert found.marker is not None
    assert found.marker.job == str(job)
    assert siblings(weights) == []


def test_a_folder_holding_other_files_is_not_deleted(tmp_path: Path, agents: Agents) -> None:
    weights = tmp_path / "shared" / "glm5"
    weights.mkdir(parents=True)
    (weights / "notes.txt").write_text("not weights")
    agent = agents.start(weights_job(tmp_path / "a", weights), "decode", 0)
    reason = agent.wait_state("failed", timeout=20)["reason"]
    assert "notes.txt" in reason, reason
    assert "never deletes" in reason, reason
    assert (weights / "notes.txt").read_text() == "not weights"
    assert siblings(weights) == []


def test_a_stopped_conversion_cleans_up(tmp_path: Path, agents: Agents) -> None:
    weights = tmp_path / "shared" / "glm5"
    job = weights_job(tmp_path / "a", weights, "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=5")
    agent = agents.start(job, "decode", 0)
    agent.wait_status("converting", lambda s: s["state"] == "converting" and s["pid"], timeout=20)
    assert siblings(weights)  # the lock and the conversion folder, while it runs
    agent.signal(signal.SIGTERM)
    assert agent.wait(timeout=20) == 0
    assert not converters_of(tmp_path)
    assert siblings(weights) == []
    assert not weights.exists()


def test_the_conversion_budget_stops_a_slow_converter(tmp_path: Path, agents: Agents) -> None:
    weights = tmp_path / "shared" / "glm5"
    job = weights_job(
        tmp_path / "a",
        weights,
        "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=5",
        "agent.convert_budget_s=1",
    )
    reason = agents.start(job, "decode", 0).wait_state("failed", timeout=30)["reason"]
    assert "agent.convert_budget_s" in reason, reason
    assert "convert.log" in reason, reason
    assert not converters_of(tmp_path)
    assert siblings(weights) == []
    assert not weights.exists()


def _small_disk_checks(agent: AgentProc, job: Path, weights: Path) -> None:
    """A conversion that ran out of space: failed naming convert.log, nothing half-written."""
    status = agent.wait_state("failed", timeout=30)
    log = job / "logs" / "decode-0" / "convert.log"
    assert str(log) in status["reason"], status["reason"]
    assert "No space left on device" in status["reason"] or "No space left" in log.read_text()
    assert "No space left on device" in log.read_text()
    assert not weights.exists()  # nothing in place
    assert siblings(weights) == []  # no conversion folder, no lock
    assert not (job / "logs" / "decode-0" / "engine.log").exists()


def test_a_full_disk_fails_clearly_with_nothing_half_written(
    tmp_path: Path, agents: Agents
) -> None:
    weights = tmp_path / "shared" / "glm5"
    job = weights_job(
        tmp_path / "a", weights, "roles.decode.env.TILERT_MOCK_CONVERT_DISK_BYTES=150000"
    )
    _small_disk_checks(agents.start(job, "decode", 0), job, weights)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 192 KiB tmpfs (root only); the stand-in converter writes more than that."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    require(
        os.geteuid() == 0,
        "mounting a tmpfs needs root (CI runs as root: .ci/run; the fill-a-small-disk switch "
        "covers the rest)",
    )
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    require(done.returncode == 0, f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_too_small_tmpfs_fails_clearly_with_nothing_half_written(
    tmp_path: Path, tiny_tmpfs: Path, agents: Agents
) -> None:
    weights = tiny_tmpfs / "glm5"
    # By default the node check refuses the load first (docs/preflight.md, disk) ...
    job = weights_job(tmp_path / "b", weights)
    reason = agents.start(job, "decode", 0).wait_state("failed", timeout=30)["reason"]
    assert "(node checks disk): disk: " in reason, reason
    assert "below agent.preflight.min_free_disk_gib 1" in reason, reason
    # ... and without it, the conversion runs out of space and says so.
    job = weights_job(tmp_path / "a", weights, "agent.preflight.disk=ignore")
    _small_disk_checks(agents.start(job, "decode", 0), job, weights)
    assert list(tiny_tmpfs.iterdir()) == []


def test_a_local_job_converting_then_serving_ends_ready(tmp_path: Path) -> None:
    weights = tmp_path / "shared" / "glm5"
    sets, _ = isolated_sets(
        None,
        f"roles.decode.args.model-weights-dir={weights}",
        f"roles.decode.convert={{source: {checkpoint(tmp_path / 'hf')}}}",
        # About 4 s of converting: seen in status.json even while the agents' preflights (their
        # engines' --help) keep two cores busy.
        "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=1",
    )
    job = tmp_path / "job"
    with LocalJob(job, sets) as local:

        def converting(status: dict[str, Any]) -> bool:
            return any(a["state"] == "converting" and "convert" in a for a in status["agents"])

        seen = wait_status(job, converting, "a decode agent converting", 30, poll_s=0.05)
        # The holder's entry: an agent still checking its converter (the preflight) shows
        # ``converting`` before it has any progress to show.
        entry = next(a for a in seen["agents"] if a["state"] == "converting" and "convert" in a)
        assert entry["convert"]["folder"] == str(weights)
        assert seen["state"] in ("starting", "waiting")
        status = local.wait_state("ready", timeout=60)
        assert [agent_entry(status, n)["state"] for n in ("decode-0", "decode-1")] == [
            "healthy",
            "healthy",
        ]
        assert all("convert" not in a for a in status["agents"])
        assert len(conversions(job)) == 1
        assert inspect(weights).complete
        code, left = local.stop(timeout=30)
        assert code == 0
        assert not left
    assert wait_state(job, "stopped", 5)["state"] == "stopped"


def test_a_converter_killed_half_way_fails_the_job_and_the_next_one_converts(
    tmp_path: Path,
) -> None:
    """The issue's check: one conversion for two decodes, then a converter SIGKILLed half way
    leaves no folder that passes the check (the waiting decode does not convert it either), and
    the next run converts from scratch."""
    weights = tmp_path / "shared" / "glm5"
    hf = checkpoint(tmp_path / "hf")
    sets, _ = isolated_sets(
        None,
        f"roles.decode.args.model-weights-dir={weights}",
        f"roles.decode.convert={{source: {hf}}}",
        "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=1",
        "roles.decode.env.TILERT_MOCK_CONVERT_SHARDS=8",
        "agent.convert_lock_stale_s=2",
    )
    job = tmp_path / "job"
    with LocalJob(job, sets):

        def converter_running(status: dict[str, Any]) -> bool:
            for entry in status["agents"]:
                convert = entry.get("convert") or {}
                if convert.get("role") == "converting" and convert.get("bytes_written", 0) > 0:
                    return True
            return False

        seen = wait_status(job, converter_running, "a converter half way", 30, poll_s=0.05)
        holder = next(
            a for a in seen["agents"] if (a.get("convert") or {}).get("role") == "converting"
        )
        pid = httpx.get(holder["status_url"], timeout=5).json()["pid"]
        assert "agent.standins.converter" in " ".join(psutil.Process(pid).cmdline())
        psutil.Process(pid).kill()
        failed = wait_state(job, "failed", 30)
    error = failed["error"]
    assert "convert.log" in error, error
    assert "killed by signal 9" in error, error
    other = next(a for a in failed["agents"] if a["name"] not in (holder["name"], "prefill-0"))
    assert "ended without completing" in other["reason"], other
    assert conversions(job) == [c for c in conversions(job) if c.startswith(holder["name"])]
    assert not inspect(weights).complete
    assert not weights.exists()
    assert siblings(weights) == []

    again = tmp_path / "again"
    sets, _ = isolated_sets(
        None,
        f"roles.decode.args.model-weights-dir={weights}",
        f"roles.decode.convert={{source: {hf}}}",
    )
    with LocalJob(again, sets) as local:
        local.wait_state("ready", timeout=60)
        assert len(conversions(again)) == 1
        assert inspect(weights).complete
        code, _ = local.stop(timeout=30)
        assert code == 0


def test_convert_job_locally(tmp_path: Path) -> None:
    """``tilert-submit convert RECIPE --local --mock``: status and logs like any job."""
    weights = tmp_path / "shared" / "glm5"
    cluster = tmp_path / "srtslurm.yaml"
    cluster.write_text("network_interface: lo\nlauncher: process\n")
    job = tmp_path / "job"
    from tests.kit import submit_cmd

    done = submit_cmd(
        "convert",
        str(Path(__file__).resolve().parent.parent / "recipes" / "local-demo.yaml"),
        "--local",
        "--mock",
        "--cluster",
        str(cluster),
        "--job-dir",
        str(job),
        "--set",
        f"roles.decode.args.model-weights-dir={weights}",
        "--set",
        f"roles.decode.convert={{source: {checkpoint(tmp_path / 'hf')}}}",
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"Job directory: {job}")
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "stopped", status
    assert status["error"] is None, status
    assert [a["name"] for a in status["agents"]] == ["decode-0"]
    assert inspect(weights).complete
    shown = submit_cmd("status", str(job))
    assert shown.returncode == 0, shown.stdout
    assert "complete" in shown.stdout, shown.stdout
    logs = submit_cmd("logs", str(job), "decode-0:convert")
    assert logs.returncode == 0, logs.stderr
    assert "decode-0:convert | " in logs.stdout, logs.stderr
    assert "Index file" in logs.stdout
    # Again: the folder is complete, nothing is converted.
    again = submit_cmd(
        "convert",
        str(Path(__file__).resolve().parent.parent / "recipes" / "local-demo.yaml"),
        "--local",
        "--mock",
        "--cluster",
        str(cluster),
        "--job-dir",
        str(tmp_path / "job2"),
        "--set",
        f"roles.decode.args.model-weights-dir={weights}",
        "--set",
        f"roles.decode.convert={{source: {tmp_path / 'hf'}}}",
        timeout=120,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert conversions(tmp_path / "job2") == []
    assert (
        time.time() - json.loads((tmp_path / "job2" / "status.json").read_text())["updated_at"] < 60
    )
