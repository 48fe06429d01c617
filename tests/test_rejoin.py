"""A dropped decode whose agent reports healthy again is taken back; one that flaps stays out.

Local mock jobs with the real TileRT router (``TILERT_ROUTER_PYTHON``, tests/infra/router_env.py).
decode-1's engine answers one request (its canary) and dies, and its agent gives up at once
(``agent.restart.max_restarts: 0``): it is dropped and the job serves ``degraded`` through
decode-0. Its agent is then restarted by hand under the same name, as systemd, Slurm or an
operator would; the stand-in's ``TILERT_MOCK_FAULT_STARTS`` makes the engine heal after its first
N starts (docs/standins.md).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests import kit
from tests.kit import Agents, running_agents

READY_S = 120.0  # bounds only: a router start takes 20 s on a loaded 2-core machine


def faulty_decode_1(counter: Path, starts: int, *extra: str) -> tuple[str, ...]:
    """decode-1 answers one request then dies, for its first ``starts`` starts; a crash is final."""
    return (
        "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
        "roles.decode.env.TILERT_MOCK_CRASH_AFTER_REQUESTS=1",
        f"roles.decode.env.TILERT_MOCK_FAULT_STARTS={starts}",
        f"roles.decode.env.TILERT_MOCK_FAULT_STARTS_FILE={counter}",
        "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 0, window_s: 60}",
        *extra,
    )


def wait_out(job: Path, rejoins: int) -> dict[str, Any]:
    """decode-1 dropped (after ``rejoins`` rejoins), the router serving through decode-0 alone."""
    return kit.wait_status(
        job,
        lambda s: (
            s["state"] == "degraded"
            and "dropped from the router" in kit.agent_entry(s, "decode-1")["reason"]
            and kit.agent_entry(s, "decode-1")["rejoins"] == rejoins
            and kit.router_decodes(job, s) == [kit.decode_spec(job, "decode-0")]
        ),
        f"degraded with decode-1 dropped after {rejoins} rejoin(s)",
        READY_S,
    )


def restart_decode_1(job: Path, agents: Agents) -> None:
    """Stop decode-1's agent (its engine failed; it exits leaving its last word) and start a new
    one under the same name, by hand."""
    old = kit.agent_process(job, "decode-1")
    old.send_signal(signal.SIGTERM)
    old.wait(30)
    record = kit.record(job, "decode-1")
    assert record.get("exited", {}).get("state") == "failed", record
    agents.start(job, "decode", 1)


def canaries_logged(job: Path) -> int:
    """How many canaries the head has seen answered so far (its agent.log)."""
    log = job / "logs" / "prefill-0" / "agent.log"
    return log.read_text(errors="replace").count("head: canary ")


def test_a_dropped_decode_that_heals_rejoins(router_python: Path, tmp_path: Path) -> None:
    """Dropped, then its agent restarted and its engine healthy: the head takes it back, restarts
    the router with both decodes, proves it with a canary each, and the job is ``ready``."""
    sets, _ = kit.isolated_sets(router_python, *faulty_decode_1(tmp_path / "starts", 1))
    with kit.LocalJob(tmp_path / "job", sets) as job, running_agents() as agents:
        wait_out(job.job, rejoins=0)
        seen = canaries_logged(job.job)
        restart_decode_1(job.job, agents)
        both = [kit.decode_spec(job.job, "decode-0"), kit.decode_spec(job.job, "decode-1")]
        status = kit.wait_status(
            job.job,
            lambda s: s["state"] == "ready" and kit.router_decodes(job.job, s) == both,
            "ready with decode-1 back in the router",
            READY_S,
        )
        d1 = kit.agent_entry(status, "decode-1")
        assert (d1["state"], d1["rejoins"]) == ("healthy", 1), d1
        assert "taken back into the router (rejoin 1 of at most 3" in d1["rejoin_reason"], d1
        assert "gave up after 0 restarts" in d1["rejoin_reason"], d1  # what dropped it
        # Proven again: a canary per live decode after the rejoin, decode-1's among them.
        assert canaries_logged(job.job) >= seen + 2
        engine_log = (job.job / "logs" / "decode-1" / "engine.log").read_text(errors="replace")
        healed = engine_log.rsplit("=== decode-1 generation", 1)[-1]
        assert "REQSTAT" in healed, engine_log[-3000:]  # the healed engine served its canary
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        shown = kit.submit_cmd("status", str(job.job)).stdout
        assert "decode-1: taken back 1 time(s)" in shown, shown
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()


def test_a_decode_that_flaps_stays_out_with_the_reason(router_python: Path, tmp_path: Path) -> None:
    """Taken back once (``agent.max_rejoins: 1``), it fails again: dropped; healthy a third time,
    it stays out, saying why, and the job serves ``degraded`` through decode-0."""
    flaps = faulty_decode_1(tmp_path / "starts", 2, "agent.max_rejoins=1")
    sets, _ = kit.isolated_sets(router_python, *flaps)
    with kit.LocalJob(tmp_path / "job", sets) as job, running_agents() as agents:
        wait_out(job.job, rejoins=0)
        restart_decode_1(job.job, agents)  # healthy, taken back, answers its canary, dies
        wait_out(job.job, rejoins=1)
        restart_decode_1(job.job, agents)  # healthy for good now: too late
        status = kit.wait_status(
            job.job,
            lambda s: (
                kit.agent_entry(s, "decode-1")["state"] == "healthy"
                and "kept out of the router"
                in (kit.agent_entry(s, "decode-1")["rejoin_reason"] or "")
            ),
            "decode-1 healthy and kept out",
            READY_S,
        )
        d1 = kit.agent_entry(status, "decode-1")
        assert "the limit of agent.max_rejoins (1)" in d1["rejoin_reason"], d1
        assert status["state"] == "degraded", status
        assert kit.router_decodes(job.job, status) == [kit.decode_spec(job.job, "decode-0")]
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
