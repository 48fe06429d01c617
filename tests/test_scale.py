"""``tilert-submit scale``: a serving local job's decode pool grown and shrunk (docs/cli.md).

A real local mock job (``--local --mock``) with TileRT's real router: ``scale --decode 3`` adds
``decode-2`` (its agent started by the local supervisor, proven by a trial router, then in the
router's list), ``scale --decode 1`` takes ``decode-1`` and ``decode-2`` out while a streaming chat
runs on ``decode-1``: the chat finishes whole, the leaving agents exit 0 with their last word.
Chats are sent throughout by a client that retries on a refused connection, and none is lost.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import kit
from tests.infra.slurm import ENDED_STATES, LocalSlurm
from tests.kit import FAST
from tests.kit.chatload import ChatLoad, stream_chat

pytestmark = pytest.mark.router

READY_S = 120.0
SCALE_S = 300.0
# Slow decode tokens, so a chat is still streaming while the pool shrinks.
TOKEN_DELAY = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.3"
# The real router's /health can take over FAST's 0.5 s on a loaded machine: not a dead router.
PROBE = "agent.probe.timeout_s=5"


def scale(
    job: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``tilert-submit scale J ...`` as a user runs it."""
    return subprocess.run(
        [*kit.SUBMIT, "scale", str(job), *args],
        cwd=kit.REPO,
        capture_output=True,
        text=True,
        env=env or kit.clean_env(),
        timeout=SCALE_S + 60,
    )


def streams_during(
    action: Callable[[], subprocess.CompletedProcess[str]], url: str, model: str
) -> list[dict[str, Any]]:
    """Two chats streaming at once (two decodes busy), ``action`` (a shrink) run meanwhile and
    passing; the chats' results once both ended."""
    started = [threading.Event(), threading.Event()]
    results: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=lambda e=e: results.append(stream_chat(url, model, e)))
        for e in started
    ]
    for thread, event in zip(threads, started, strict=True):
        thread.start()
        assert event.wait(60), "the chat never streamed"
    done = action()
    assert done.returncode == 0, done.stdout + done.stderr
    for thread in threads:
        thread.join(120)
    assert len(results) == 2, "a chat failed (see the warnings)"
    return results


def pool(status: dict[str, Any]) -> dict[str, str]:
    """Each decode row's place in the pool."""
    return {a["name"]: a.get("pool") for a in status["agents"] if a["role"] == "decode"}


def test_scale_up_then_down_under_a_streaming_chat(tmp_path: Path, router_python: Path) -> None:
    """Grow 2 -> 3, shrink 3 -> 1 with a chat streaming on a leaving decode; chats throughout."""
    args, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, PROBE)
    job_dir = tmp_path / "job"
    with kit.LocalJob(job_dir, args) as job:
        status = job.wait_state("ready", timeout=READY_S)
        url, model = status["router_url"], status["model"]
        load = ChatLoad(url, model).start()

        grown = scale(job_dir, "--decode", "3")
        assert grown.returncode == 0, grown.stdout + grown.stderr
        status = job.status()
        assert pool(status) == {n: "member" for n in ("decode-0", "decode-1", "decode-2")}
        assert "decode-2 started" in job.output()  # the local supervisor started its agent
        head_log = (job_dir / "logs" / "prefill-0" / "agent.log").read_text()
        assert "proving decode-2 through a trial router" in head_log
        assert "canary 1/1 answered" in head_log
        trial = (job_dir / "logs" / "prefill-0" / "router-trial.log").read_text()
        assert "trial router for decode-2" in trial
        # Three chats at once are served by three decodes (one request each at a time).
        assert len(kit.chat_concurrently(url, model, 3)) == 3
        assert kit.record(job_dir, "decode-2")["index"] == 2

        # Two chats streaming (one on a leaving decode at least) while the pool shrinks.
        results = streams_during(lambda: scale(job_dir, "--decode", "1"), url, model)
        full = stream_chat(url, model)
        for result in results:
            assert result["text"] == full["text"], result
            assert result["finish"] == full["finish"], result

        status = job.status()
        assert pool(status) == {"decode-0": "member"}
        for name in ("decode-1", "decode-2"):
            exited = kit.record(job_dir, name)["exited"]
            assert exited["code"] == 0, exited
            assert exited["state"] == "stopped", exited
            assert "left the pool" in exited["reason"], exited
        load.finish()
        assert not load.failures, load.failures
        assert load.served > 0
        code, left = job.stop(60)
        assert code == 0
        assert not left


def test_scale_refuses_bad_input(tmp_path: Path) -> None:
    """``--decode 0`` and a ``--leave`` that is not a decode of the pool: exit 2, one line."""
    job_dir = kit.make_job(tmp_path)
    for argv, words in (
        (["--decode", "0"], "--decode 0"),
        (["--decode", "1", "--leave", "decode-7"], "--leave decode-7"),
    ):
        done = scale(job_dir, *argv)
        assert done.returncode == 2, done.stdout + done.stderr
        assert words in done.stderr
        assert "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slurm
def test_scale_on_slurm_with_a_second_job(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    """On the local Slurm: 1 decode grown to 2 by a second Slurm job (its agent decode-1, its
    record naming that job), shrunk back to 1 under a streaming chat (the second job ends when
    its agent has left), grown again, then ``stop`` ends both jobs."""
    sets, _ = kit.isolated_sets(
        router_python, TOKEN_DELAY, PROBE, "roles.decode.nodes=1", "roles.decode.workers=1"
    )
    job_dir = tmp_path / "job"
    done = kit.submit_cmd(
        str(kit.DEMO_RECIPE),
        "--mock",
        "--cluster",
        str(slurm_cluster_file),
        "--job-dir",
        str(job_dir),
        *sets,
        env=slurm.env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first = kit.current_status(job_dir)["slurm_job_id"]
    try:
        status = kit.wait_state(job_dir, "ready", READY_S)
        url, model = status["router_url"], status["model"]
        load = ChatLoad(url, model).start()

        grown = scale(job_dir, "--decode", "2", env=slurm.env)
        assert grown.returncode == 0, grown.stdout + grown.stderr
        grow_jobs = json.loads((job_dir / "pool.json").read_text())["grow_jobs"]
        second = grow_jobs[0]["slurm_job_id"]
        assert second != first
        assert grow_jobs[0]["indexes"] == [1]
        status = kit.current_status(job_dir)
        assert pool(status) == {"decode-0": "member", "decode-1": "member"}
        assert kit.agent_entry(status, "decode-1")["slurm_job_id"] == second
        assert kit.agent_entry(status, "decode-0")["slurm_job_id"] == first
        shown = kit.submit_cmd("status", str(job_dir), env=slurm.env).stdout
        assert f"(slurm {second})" in shown

        results = streams_during(lambda: scale(job_dir, "--decode", "1", env=slurm.env), url, model)
        full = stream_chat(url, model)
        assert [r["text"] for r in results] == [full["text"]] * 2
        exited = kit.record(job_dir, "decode-1")["exited"]
        assert exited["code"] == 0, exited
        assert "left the pool" in exited["reason"], exited
        assert slurm.wait_job_end(second, timeout=60) in ENDED_STATES
        assert slurm.job_state(first) not in (None, *ENDED_STATES)

        again = scale(job_dir, "--decode", "2", env=slurm.env)
        assert again.returncode == 0, again.stdout + again.stderr
        third = json.loads((job_dir / "pool.json").read_text())["grow_jobs"][-1]["slurm_job_id"]
        load.finish()
        assert not load.failures, load.failures
        stopped = kit.submit_cmd("stop", str(job_dir), env=slurm.env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        for job_id in (first, third):
            assert slurm.wait_job_end(job_id, timeout=60) in ENDED_STATES
    finally:
        kit.kill_all(kit.job_processes(job_dir, kit.job_ports(job_dir)))
