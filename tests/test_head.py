"""The head's decisions on data alone: gate, dropping a failed decode, fatal; the helpers that
build what a peer says (tests/test_head_peers.py tests the peers).

No process, socket or job is started: the decisions read a ``JobView`` built here. The canaries'
tests are tests/test_canaries.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from agent.head.decisions import (
    JobView,
    fatal,
    gate,
    last_healthy,
    proof_due,
    restart_marks,
    serving_state,
    startup_overrun,
    to_drop,
    version_mismatch,
    waiting_for,
)
from agent.head.peers import Peer
from agent.job.names import HEAD_NAME, ROUTER_NAME, agent_names, parse_agent_name
from agent.job.records import (
    AgentStatus,
    JobAgent,
    RendezvousRecord,
)
from agent.job.vocab import AgentState, EngineState, Process

LOG = logging.getLogger("test_head")
ROUTER_LOG = Path("/j/logs/prefill-0/router.log")


def row(name: str, state: AgentState = "healthy", reason: str = "serving") -> JobAgent:
    """An agent's status.json row as the head would build it."""
    parsed = parse_agent_name(name)
    role: Process = parsed[0] if parsed else "router"
    index = parsed[1] if parsed else 0
    return JobAgent(
        name=name,
        role=role,
        index=index,
        node=f"node-{name}",
        state=state,
        restarts=0,
        reason=reason,
        log=f"/j/logs/{name}/engine.log",
        metrics_url=None,
        status_url=None,
    )


def view(
    states: dict[str, AgentState] | None = None,
    *,
    decodes: int = 2,
    healthy_since: Mapping[str, float | None] | None = None,
    router: AgentState | None = None,
    versions: dict[str, str] | None = None,
) -> JobView:
    """A job of prefill-0 and ``decodes`` decodes, every one healthy unless ``states`` says."""
    states = states or {}
    return JobView(
        agents={
            n: row(n, states.get(n, "healthy"), reason=f"{n} reason")
            for n in agent_names(1, decodes)
        },
        healthy_since=healthy_since or {},
        versions=versions or {},
        router=row(ROUTER_NAME, router, reason="router reason") if router else None,
    )


# ---- gate ------------------------------------------------------------------------------------


def test_gate_waits_for_every_live_worker() -> None:
    for name in agent_names(1, 2):
        for state in ("missing", "starting", "unhealthy", "restarting", "unreachable"):
            assert gate(view({name: state}), now=100.0) is None, (name, state)


def test_gate_returns_when_the_last_worker_turned_healthy() -> None:
    since = {HEAD_NAME: 10.0, "decode-0": 30.0, "decode-1": 20.0}
    assert gate(view(healthy_since=since), now=100.0) == 30.0


def test_gate_counts_an_unseen_turn_to_healthy_as_now() -> None:
    since: dict[str, float | None] = {HEAD_NAME: 10.0, "decode-0": None, "decode-1": 20.0}
    assert gate(view(healthy_since=since), now=100.0) == 100.0


def test_a_failed_decode_does_not_block_the_gate() -> None:
    # decode-1 failed (after having been healthy late): the gate opens on the others' times.
    since = {HEAD_NAME: 10.0, "decode-0": 30.0, "decode-1": 50.0}
    assert gate(view({"decode-1": "failed"}, healthy_since=since), now=100.0) == 30.0


def test_a_failed_prefill_blocks_the_gate() -> None:
    assert gate(view({HEAD_NAME: "failed"}), now=100.0) is None


def test_the_gate_users_wait_for_starts_at_the_last_live_workers_own_healthy() -> None:
    # Each worker's own clock (its /status healthy_at), not when the head heard of it; a failed
    # decode is not waited for, so its time does not count.
    at = {HEAD_NAME: 1000.5, "decode-0": 1000.9, "decode-1": 1001.7}
    assert last_healthy(replace(view(), healthy_at=at)) == ("decode-1", 1001.7)
    failed = replace(view({"decode-1": "failed"}), healthy_at=at)
    assert last_healthy(failed) == ("decode-0", 1000.9)
    assert last_healthy(replace(view(), healthy_at={**at, "decode-0": None})) is None


def test_waiting_for_names_each_unhealthy_agent_with_its_state() -> None:
    assert waiting_for(view({"decode-0": "missing", "decode-1": "starting"})) == (
        "decode-0 (missing), decode-1 (starting)"
    )


def test_startup_overrun_names_each_late_agent_with_reason_and_log() -> None:
    message = startup_overrun(view({"decode-1": "starting"}), 600.0)
    assert message == (
        "still waiting after the startup budget of 600s: decode-1 on node-decode-1 starting: "
        "decode-1 reason (log: /j/logs/decode-1/engine.log)"
    )


# ---- dropping a failed decode ----------------------------------------------------------------


def test_a_failed_decode_is_dropped_once() -> None:
    failed = view({"decode-1": "failed"})
    assert to_drop(failed, dropped=()) == ["decode-1"]
    assert to_drop(failed, dropped={"decode-1": "why"}) == []


def test_unhealthy_decodes_are_not_dropped() -> None:
    states: dict[str, AgentState] = {"decode-0": "unhealthy", "decode-1": "restarting"}
    assert to_drop(view(states), dropped=()) == []


def test_the_prefill_is_never_dropped() -> None:
    assert to_drop(view({HEAD_NAME: "failed"}), dropped=()) == []
    assert to_drop(view({HEAD_NAME: "failed", "decode-0": "failed"}), ()) == ["decode-0"]


def test_serving_with_a_dropped_decode_is_degraded() -> None:
    healthy = view({"decode-1": "failed"}, router="healthy")
    assert serving_state(healthy, dropped={"decode-1": "why"}) == (
        "degraded",
        "decode-1 dropped",
    )
    restarting = view({"decode-1": "failed"}, router="restarting")
    assert serving_state(restarting, dropped={"decode-1": "why"}) == (
        "degraded",
        "router (restarting), decode-1 dropped",
    )


def test_serving_is_ready_only_when_everything_is_healthy() -> None:
    assert serving_state(view(router="healthy"), dropped={}) == (
        "ready",
        "every worker and the router healthy",
    )
    assert serving_state(view({"decode-0": "unhealthy"}, router="healthy"), dropped={}) == (
        "degraded",
        "decode-0",
    )


# ---- ready means proven ----------------------------------------------------------------------


def restarted(v: JobView, name: str, times: int = 1) -> JobView:
    """``v`` after ``name`` (an agent or the router) restarted ``times`` more times."""
    if name == ROUTER_NAME:
        assert v.router is not None
        return replace(
            v, router=msgspec.structs.replace(v.router, restarts=v.router.restarts + times)
        )
    agents = dict(v.agents)
    agents[name] = msgspec.structs.replace(agents[name], restarts=agents[name].restarts + times)
    return replace(v, agents=agents)


def test_restart_marks_count_every_agent_and_the_router() -> None:
    v = restarted(restarted(view(router="healthy"), "decode-1", 2), ROUTER_NAME)
    assert restart_marks(v) == {HEAD_NAME: 0, "decode-0": 0, "decode-1": 2, ROUTER_NAME: 1}


def test_no_proof_is_due_while_nothing_restarted() -> None:
    v = view(router="healthy")
    assert not proof_due(v, dropped={}, proven=restart_marks(v))


@pytest.mark.parametrize("who", [HEAD_NAME, "decode-0", ROUTER_NAME])
def test_a_restart_makes_a_proof_due_once_everything_is_healthy_again(who: str) -> None:
    before = view(router="healthy")
    proven = restart_marks(before)
    # Still restarting: no canary yet (it would fail), and the job is degraded.
    during = restarted(
        view(
            {who: "restarting"} if who != ROUTER_NAME else {},
            router="restarting" if who == ROUTER_NAME else "healthy",
        ),
        who,
    )
    assert not proof_due(during, dropped={}, proven=proven)
    assert serving_state(during, dropped={}, proven=False)[0] == "degraded"
    # Healthy again: a canary is due, and until it passes the job is degraded, not ready.
    after = restarted(before, who)
    assert proof_due(after, dropped={}, proven=proven)
    assert serving_state(after, dropped={}, proven=False) == (
        "degraded",
        "healthy again; waiting for a canary through the router",
    )
    assert serving_state(after, {}, proven=False, proof="healthy again; canary running") == (
        "degraded",
        "healthy again; canary running",
    )
    # Proven again.
    assert not proof_due(after, dropped={}, proven=restart_marks(after))
    assert serving_state(after, dropped={}, proven=True)[0] == "ready"


def test_a_dropped_decode_and_the_restarted_router_need_a_proof_too() -> None:
    before = view(router="healthy")
    proven = restart_marks(before)
    after = restarted(view({"decode-1": "failed"}, router="healthy"), ROUTER_NAME)
    assert proof_due(after, dropped={"decode-1": "why"}, proven=proven)
    assert serving_state(after, {"decode-1": "why"}, proven=False) == (
        "degraded",
        "decode-1 dropped, healthy again; waiting for a canary through the router",
    )
    assert serving_state(after, {"decode-1": "why"}, proven=True) == (
        "degraded",
        "decode-1 dropped",
    )


# ---- fatal -----------------------------------------------------------------------------------


def test_a_healthy_job_or_one_failed_decode_is_not_fatal() -> None:
    assert fatal(view(router="healthy")) is None
    assert fatal(view({"decode-0": "failed"}, router="healthy")) is None


def test_a_failed_prefill_is_fatal() -> None:
    assert fatal(view({HEAD_NAME: "failed"})) == (
        "prefill-0 on node-prefill-0 failed: prefill-0 reason (log: /j/logs/prefill-0/engine.log)"
    )


def test_every_decode_failed_is_fatal() -> None:
    message = fatal(view({"decode-0": "failed", "decode-1": "failed"}))
    assert message == (
        "every decode worker failed: "
        "decode-0 on node-decode-0 failed: decode-0 reason (log: /j/logs/decode-0/engine.log); "
        "decode-1 on node-decode-1 failed: decode-1 reason (log: /j/logs/decode-1/engine.log)"
    )
    assert fatal(view({"decode-0": "failed"}, decodes=1)) is not None


def test_a_failed_router_is_fatal() -> None:
    assert fatal(view(router="failed")) == (
        "router failed: router reason (log: /j/logs/router/engine.log)"
    )


def test_a_tilert_version_mismatch_is_fatal() -> None:
    versions = {HEAD_NAME: "0.1.6", "decode-0": "0.1.6", "decode-1": "0.1.7"}
    assert fatal(view(versions=versions)) == (
        "tilert versions differ: prefill-0 has tilert 0.1.6, decode-1 has tilert 0.1.7; "
        "the control protocol needs the same version on both sides: "
        "use matching prefill and decode images"
    )


def test_matching_or_unknown_tilert_versions_are_fine() -> None:
    assert version_mismatch({HEAD_NAME: "0.1.6", "decode-0": "0.1.6"}) is None
    # Without the head's version there is nothing to compare against.
    assert version_mismatch({"decode-0": "0.1.6", "decode-1": "0.1.7"}) is None


# ---- what the head sees of a peer ------------------------------------------------------------


def status(state: EngineState, name: str = "decode-0", reason: str = "serving") -> AgentStatus:
    parsed = parse_agent_name(name)
    role, index = parsed if parsed else ("decode", 0)
    return AgentStatus(
        state=state,
        pid=None,
        ports={},
        restarts=1,
        reason=reason,
        since=0.0,
        uptime_s=None,
        name=name,
        role=role,
        index=index,
        node="n",
    )


def record(name: str, tilert: str | None = None) -> RendezvousRecord:
    return RendezvousRecord(
        name=name,
        role="decode",
        index=0,
        node=f"node-{name}",
        address="10.0.0.1",
        ports={"http": 8200, "ctrl": 8300, "agent": 9200},
        status_url="http://10.0.0.1:9200/status",
        metrics_url="http://10.0.0.1:9200/metrics",
        versions={"tilert": tilert} if tilert else {},
    )


def state_of(peer: Peer) -> AgentState:
    """The peer's state, read afresh (an assert on ``peer.state`` would narrow its type)."""
    return peer.state
