"""The head's decisions on data alone: gate, dropping a failed decode, fatal, peers.

No process, socket or job is started: the decisions read a ``JobView`` built here. The canaries'
tests are tests/test_canaries.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

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
from agent.head.peers import UNREACHABLE_FAIL_S, Peer, Peers
from agent.http.longpoll import ClientFetch
from agent.job.names import HEAD_NAME, ROUTER_NAME, agent_names, parse_agent_name
from agent.job.paths import JobDir
from agent.job.records import (
    AgentExit,
    AgentStatus,
    JobAgent,
    JobStatus,
    RendezvousRecord,
)
from agent.job.vocab import AgentState, EngineState, Process
from agent.node.jobwrites import JobWrites
from agent.node.rendezvous import Records, write_record
from agent.node.statuswriter import StatusWriter
from tests import kit

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


def test_peer_state_tells_missing_lost_and_stopped_apart() -> None:
    peer = Peer()
    assert state_of(peer) == "missing"
    peer.record = record("decode-0")
    assert state_of(peer) == "starting"
    peer.observe(status("healthy"), now=5.0)
    peer.reachable = True
    assert state_of(peer) == "healthy"
    peer.reachable = False
    assert state_of(peer) == "unreachable"
    peer.observe(status("stopping"), now=6.0)
    peer.reachable = False
    assert state_of(peer) == "stopped"


def test_peer_notes_when_it_turned_healthy_not_each_healthy_answer() -> None:
    peer = Peer(record=record("decode-0"), reachable=True)
    peer.observe(status("starting"), now=1.0)
    assert peer.healthy_seen_at is None
    peer.observe(status("healthy"), now=2.0)
    peer.observe(status("healthy"), now=3.0)
    assert peer.healthy_seen_at == 2.0
    peer.observe(status("restarting"), now=4.0)
    peer.observe(status("healthy"), now=5.0)
    assert peer.healthy_seen_at == 5.0


def test_peers_rows_feed_the_decisions(tmp_path: Path) -> None:
    names = list(agent_names(1, 2))
    peers = Peers(
        names,
        job=JobDir(tmp_path),
        own_status=lambda: status("healthy", HEAD_NAME),
        log=LOG,
        on_change=lambda: None,
    )
    peers.by_name["decode-0"] = Peer(record=record("decode-0", "0.2"), reachable=True)
    peers.by_name["decode-0"].observe(status("failed", reason="exit 1"), now=1.0)
    peers.by_name[HEAD_NAME].record = record(HEAD_NAME, "0.1")
    assert peers.state(HEAD_NAME) == "healthy"  # read live from the head's own agent
    assert peers.state("decode-1") == "missing"
    assert peers.versions() == {HEAD_NAME: "0.1", "decode-0": "0.2"}
    dropped = peers.entry("decode-0", dropped="decode-0 on n failed")
    assert (dropped.role, dropped.index, dropped.node, dropped.state) == (
        "decode",
        0,
        "node-decode-0",
        "failed",
    )
    assert dropped.reason == "dropped from the router: decode-0 on n failed"
    assert peers.entry("decode-1").reason == "no rendezvous record yet"
    rows = JobView(agents={n: peers.entry(n) for n in names}, versions=peers.versions())
    assert to_drop(rows, dropped=()) == ["decode-0"]
    assert fatal(rows) is not None
    assert "tilert versions differ" in (fatal(rows) or "")


def test_a_record_that_stays_unreadable_fails_its_peer_not_the_job() -> None:
    peer = Peer(record_problem="J/rendezvous/decode-1.json: not JSON, or cut short")
    assert (state_of(peer), peer.reason) == (
        "failed",
        "J/rendezvous/decode-1.json: not JSON, or cut short",
    )
    rows = view({"decode-1": "failed"}, router="healthy")
    assert fatal(rows) is None
    assert to_drop(rows, dropped=()) == ["decode-1"]
    assert gate(view({"decode-1": "failed"}), now=1.0) is not None  # not waited for


def test_a_bad_file_over_a_good_record_keeps_the_peer_and_says_so() -> None:
    peer = Peer(record=record("decode-1"))
    peer.observe(status("healthy", "decode-1"), now=1.0)
    peer.record_problem = "J/rendezvous/decode-1.json: a symbolic link, not followed"
    assert state_of(peer) == "healthy"
    assert peer.reason == (
        "serving; J/rendezvous/decode-1.json: a symbolic link, not followed "
        "(its last good record is used)"
    )


def test_a_last_word_in_the_record_fails_the_peer_at_once() -> None:
    last = record("decode-1")
    last.exited = AgentExit(state="failed", reason="agent crashed: OSError: boom\nx", code=1)
    peer = Peer(record=last)
    assert state_of(peer) == "failed"
    assert peer.reason == "its agent exited with code 1: agent crashed: OSError: boom\\nx"
    last.exited = AgentExit(state="stopped", reason="stopped on request", code=0)
    assert state_of(peer) == "stopped"


def test_an_unreachable_peer_is_failed_after_the_bound_until_it_answers_again() -> None:
    peer = Peer(record=record("decode-1"))
    peer.observe(status("healthy", "decode-1"), now=0.0)
    assert peer.unanswered("connection refused", now=10.0) is False  # asked again at once
    assert state_of(peer) == "healthy"
    assert peer.unanswered("connection refused", now=10.2) is True
    assert (state_of(peer), peer.lost) == ("unreachable", None)
    assert "not answering at http://10.0.0.1:9200/status (connection refused)" in peer.reason
    assert peer.unanswered("connection refused", now=10.0 + UNREACHABLE_FAIL_S - 0.1) is False
    assert state_of(peer) == "unreachable"
    assert peer.unanswered("connection refused", now=10.0 + UNREACHABLE_FAIL_S) is True
    assert state_of(peer) == "failed"
    assert peer.reason == (
        f"agent not answering for {UNREACHABLE_FAIL_S:g}s at http://10.0.0.1:9200/status "
        "(connection refused); it last said healthy: taken as failed"
    )
    # Back (thawed, its network healed): what it says again; the head decides whether a dropped
    # decode comes back (decisions.to_rejoin, bounded by agent.max_rejoins).
    assert peer.observe(status("healthy", "decode-1"), now=20.0) is True
    assert (state_of(peer), peer.lost) == ("healthy", None)


def test_one_failed_poll_alone_shows_nothing() -> None:
    # A long poll cut short by the head's own pause (frozen, starved) is asked again at once.
    peer = Peer(record=record("decode-1"))
    peer.observe(status("healthy", "decode-1"), now=0.0)
    for now in (10.0, 20.0, 30.0):
        assert peer.unanswered("timed out", now=now) is False
        peer.observe(status("healthy", "decode-1"), now=now + 0.1)
        assert state_of(peer) == "healthy"
        assert peer.reason == "serving"


def test_a_peer_that_never_answered_turns_unreachable() -> None:
    peer = Peer(record=record("decode-1"))
    peer.unanswered("connection refused", now=0.0)
    assert state_of(peer) == "starting"
    peer.unanswered("connection refused", now=0.2)
    assert state_of(peer) == "unreachable"
    assert peer.unanswered("connection refused", now=UNREACHABLE_FAIL_S) is True
    assert state_of(peer) == "failed"
    assert "it last said" not in peer.reason


def test_an_answer_ends_an_outage_before_the_bound() -> None:
    peer = Peer(record=record("decode-1"))
    peer.observe(status("healthy", "decode-1"), now=0.0)
    peer.unanswered("timed out", now=1.0)
    peer.unanswered("timed out", now=2.0)
    assert state_of(peer) == "unreachable"
    peer.observe(status("healthy", "decode-1"), now=4.0)
    peer.unanswered("timed out", now=8.0)  # a new outage starts now, not at 1
    assert peer.unanswered("timed out", now=8.0 + UNREACHABLE_FAIL_S - 0.1) is True
    assert state_of(peer) == "unreachable"


def test_a_peer_that_said_it_was_stopping_and_went_away_stopped() -> None:
    peer = Peer(record=record("decode-1"))
    peer.observe(status("stopping", "decode-1"), now=0.0)
    for now in (1.0, 1.2, 1.0 + 2 * UNREACHABLE_FAIL_S):
        peer.unanswered("connection refused", now=now)
    assert (state_of(peer), peer.lost) == ("stopped", None)


async def test_peers_take_bad_files_and_strays_logging_each_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG.name)
    names = list(agent_names(1, 2))
    peers = Peers(
        names,
        job=JobDir(tmp_path),
        own_status=lambda: status("healthy", HEAD_NAME),
        log=LOG,
        on_change=lambda: None,
    )
    problem = "J/rendezvous/decode-1.json: empty"
    found = Records(
        by_name={"decode-0": record("decode-0")},
        problems={"decode-1": problem},
        strays=["notes.json"],
    )
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            peers._take(found, nursery)
        nursery.cancel_scope.cancel()
    assert peers.state("decode-1") == "failed"
    assert peers.entry("decode-1").reason == problem
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"head: ignoring notes.json in {tmp_path}/rendezvous: not the record of an agent of "
        "this job (prefill-0, decode-0, decode-1)",
        f"head: decode-1: {problem}",
    ]


async def test_peers_follow_every_peer_over_the_agents_one_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client per peer built an SSL context each (~25 ms): 1,024 peers took 25 s to follow.
    job = JobDir(tmp_path)
    job.rendezvous.mkdir()
    names = list(agent_names(1, 3))
    for name in names[1:]:
        url = f"http://p:9200/{name}/status"
        index = int(name.rsplit("-", 1)[1])
        write_record(job, msgspec.structs.replace(record(name), index=index, status_url=url))
    polls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/")[1]
        polls.append(name)
        if request.url.params["after"] != "-1":
            await trio.sleep_forever()  # a long poll: nothing changes
        return httpx.Response(200, content=msgspec.json.encode(status("healthy", name)))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    def no_second_client(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the head built an HTTP client of its own")

    monkeypatch.setattr(httpx.AsyncClient, "__init__", no_second_client)
    peers = Peers(
        names,
        job=job,
        own_status=lambda: status("healthy", HEAD_NAME),
        log=LOG,
        on_change=lambda: None,
        fetch=lambda: ClientFetch(client),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peers.follow, lambda: None)
        await kit.until(
            lambda: all(peers.state(n) == "healthy" for n in names), "every peer healthy"
        )
        nursery.cancel_scope.cancel()
    assert sorted(set(polls)) == names[1:]


async def test_a_peer_answering_an_unknown_state_is_unreachable_alone(tmp_path: Path) -> None:
    # States are typed words (agent.job.vocab): an answer with another word (a newer or broken
    # agent) is no answer. That peer turns unreachable (then failed after the bound, as any peer
    # that does not answer); the others are followed as before.
    job = JobDir(tmp_path)
    job.rendezvous.mkdir()
    names = list(agent_names(1, 3))
    for name in names[1:]:
        url = f"http://p:9200/{name}/status"
        index = int(name.rsplit("-", 1)[1])
        write_record(job, msgspec.structs.replace(record(name), index=index, status_url=url))

    async def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/")[1]
        if request.url.params["after"] != "-1":
            await trio.sleep_forever()  # a long poll: nothing changes
        answer = msgspec.to_builtins(status("healthy", name))
        if name == "decode-1":
            answer["state"] = "exploded"
        return httpx.Response(200, content=msgspec.json.encode(answer))

    peers = Peers(
        names,
        job=job,
        own_status=lambda: status("healthy", HEAD_NAME),
        log=LOG,
        on_change=lambda: None,
        fetch=lambda: ClientFetch(httpx.AsyncClient(transport=httpx.MockTransport(handler))),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peers.follow, lambda: None)
        await kit.until(lambda: peers.state("decode-1") == "unreachable", "decode-1 unreachable")
        await kit.until(
            lambda: all(peers.state(n) == "healthy" for n in names if n != "decode-1"),
            "the other peers healthy",
        )
        nursery.cancel_scope.cancel()
    assert "Invalid enum value 'exploded'" in peers.by_name["decode-1"].reason


def test_status_json_is_written_on_change_and_by_the_heartbeat(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    state = JobStatus(state="waiting", model="m")
    writer = StatusWriter(job, lambda: state, JobWrites(LOG, on_change=lambda: None))
    writer.write()
    assert job.read_status().state == "waiting"
    job.status.unlink()
    state.updated_at += 1  # a new time alone is no change
    writer.write()
    assert not job.status.exists()
    writer.write(force=True)  # the heartbeat
    assert job.status.exists()
    state.state = "ready"
    writer.write()
    assert job.read_status().state == "ready"


def test_status_json_and_targets_that_cannot_be_written_never_raise(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "removed")
    writes = JobWrites(LOG, on_change=lambda: None)
    writer = StatusWriter(job, lambda: JobStatus(state="ready", model="m"), writes)
    writer.write()
    writer.write(force=True)
    writer.write_targets({"decode-0": record("decode-0")})
    assert writes.problems() == [
        f"cannot write {job.status}: No such file or directory",
        f"cannot write {job.targets}: No such file or directory",
    ]
    job.prometheus.mkdir(parents=True)
    writer.write()  # changed or not: what failed is written once it can be
    writer.write_targets({"decode-0": record("decode-0")})
    assert writes.problems() == []
    assert job.read_status().state == "ready"
