"""Agents the job did not start end with it, and say which secrets they lack (docs/agent.md,
"When the job ends").

A local mock job with the stand-ins: decode-1's agent is stopped and started again by hand under
the same name (a rejoin, as an operator or systemd would), with a clean environment that lacks the
recipe's ``HF_TOKEN``. It says so at start; the job's own agents, which inherited it, do not. Then
``tilert-submit stop J`` ends the job: the ``--local`` supervisor stops the agents it started, and
the hand-started one, which no signal reaches, drains and exits 0 by itself, its engine with it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests import kit

READY_S = 60.0
# Bounds only: the end is seen within agent.node.jobwatch.POLL_S (2 s), then the engine's drain.
END_S = 60.0
MISSING = (
    "decode-1: HF_TOKEN is not in this agent's environment, and the recipe gives it to its decode"
)


def agent_log(job: Path, name: str) -> str:
    """``J/logs/<name>/agent.log`` now."""
    return (job / "logs" / name / "agent.log").read_text(errors="replace")


def test_a_hand_started_agent_ends_with_the_job_and_names_the_secrets_it_lacks(
    tmp_path: Path,
) -> None:
    sets, _ = kit.isolated_sets(None, "roles.decode.env.HF_TOKEN=@env:MY_HF_TOKEN")
    env = {**os.environ, "MY_HF_TOKEN": "tok-4Rz9"}
    with kit.LocalJob(tmp_path / "job", sets, env=env) as job, kit.running_agents() as agents:
        job.wait_state("ready", timeout=READY_S)
        for name in ("prefill-0", "decode-0", "decode-1"):
            assert "is not in this agent's environment" not in agent_log(job.job, name), name
        old = kit.agent_process(job.job, "decode-1")
        old.send_signal(signal.SIGTERM)
        old.wait(30)
        hand = agents.start(job.job, "decode", 1)  # kit.clean_env(): no HF_TOKEN
        kit.wait_for(
            "the missing secret said", lambda: MISSING in agent_log(job.job, "decode-1"), 30
        )
        # Its own /status: status.json's decode-1 row can still be the old agent's ``healthy``.
        hand.wait_state("healthy", READY_S)
        kit.wait_status(
            job.job,
            lambda s: kit.agent_entry(s, "decode-1")["state"] == "healthy",
            "the hand-started decode-1 healthy",
            READY_S,
        )
        hand.remember_tree()
        assert len(hand.seen) >= 2, kit.describe(hand.seen.values())  # the agent and its engine
        stop = kit.submit_cmd("stop", str(job.job), timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert job.wait_exit(30) == 0, job.output()
        assert kit.current_status(job.job)["state"] == "stopped"
        assert hand.wait(END_S) == 0
        left = kit.still_alive(hand.seen.values(), 10)
        assert not left, kit.describe(left)
    exited = kit.record(job.job, "decode-1")["exited"]
    assert exited["state"] == "stopped", exited
    assert exited["reason"].startswith("stopped with the job: the job stopped (status.json"), exited
    assert "decode-1: the job stopped (status.json" in agent_log(job.job, "decode-1")
