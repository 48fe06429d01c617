"""``tilert-submit scale``: a serving local job's decode pool grown and shrunk (docs/cli.md).

A real local mock job (``--local --mock``) with TileRT's real router: ``scale --decode 3`` adds
``decode-2`` (its agent started by the local supervisor, proven by a trial router, then in the
router's list), ``scale --decode 1`` takes ``decode-1`` and ``decode-2`` out while a streaming chat
runs on ``decode-1``: the chat finishes whole, the leaving agents exit 0 with their last word.
Chats are sent throughout by a client that retries on a refused connection, and none is lost.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests import kit
from tests.kit import FAST
from tests.kit.chatload import ChatLoad, stream_chat

pytestmark = pytest.mark.router

READY_S = 120.0
SCALE_S = 300.0
# Slow decode tokens, so a chat is still streaming while the pool shrinks.
TOKEN_DELAY = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.3"
# The old router finishes its streams within its grace (FAST's 2 s would cut a 3 s chat).
ROUTER_GRACE = "agent.stop_grace_s.router=30"


def scale(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tilert-submit scale J ...`` as a user runs it."""
    return subprocess.run(
        [*kit.SUBMIT, "scale", str(job), *args],
        cwd=kit.REPO,
        capture_output=True,
        text=True,
        env=kit.clean_env(),
        timeout=SCALE_S + 60,
    )


def pool(status: dict[str, Any]) -> dict[str, str]:
    """Each decode row's place in the pool."""
    return {a["name"]: a.get("pool") for a in status["agents"] if a["role"] == "decode"}


def test_scale_up_then_down_under_a_streaming_chat(tmp_path: Path, router_python: Path) -> None:
    """Grow 2 -> 3, shrink 3 -> 1 with a chat streaming on a leaving decode; chats throughout."""
    args, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, ROUTER_GRACE)
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

        # decode-0 busy with one chat, the next one streams through decode-1, which leaves.
        busy = [threading.Event(), threading.Event()]
        results: list[dict[str, Any]] = []
        streams = [
            threading.Thread(target=lambda e=e: results.append(stream_chat(url, model, e)))
            for e in busy
        ]
        for stream, started in zip(streams, busy, strict=True):
            stream.start()
            assert started.wait(60), "the chat never streamed"
        shrunk = scale(job_dir, "--decode", "1")
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        for stream in streams:
            stream.join(120)
        assert len(results) == 2
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
