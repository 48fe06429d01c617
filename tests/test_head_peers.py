"""What the head sees of its peers, on data alone: each peer's state from its answers and its
record, the rows they feed the decisions, and status.json as the head writes it.

No job is started: peers are fed answers and records here (tests/test_head.py builds them).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from agent.head.decisions import (
    JobView,
    fatal,
    gate,
    to_drop,
)
from agent.head.peers import UNREACHABLE_FAIL_S, Peer, Peers
from agent.http.longpoll import ClientFetch
from agent.job.names import HEAD_NAME, agent_names
from agent.job.paths import JobDir
from agent.job.records import (
    AgentExit,
    JobStatus,
)
from agent.node.jobwrites import JobWrites
from agent.node.rendezvous import Records, write_record
from agent.node.statuswriter import StatusWriter
from tests import kit
from tests.test_head import LOG, record, state_of, status, view


def job_of_three(tmp_path: Path) -> tuple[JobDir, list[str]]:
    """A job directory whose two decodes published records with a status URL at ``p:9200``."""
    job = JobDir(tmp_path)
    job.rendezvous.mkdir()
    names = list(agent_names(1, 3))
    for name in names[1:]:
        url = f"http://p:9200/{name}/status"
        index = int(name.rsplit("-", 1)[1])
        write_record(job, msgspec.structs.replace(record(name), index=index, status_url=url))
    return job, names


def head_peers(names: list[str], job: JobDir, **kwargs: Any) -> Peers:
    """The head's peers of ``names`` in ``job``, its own status healthy."""
    return Peers(
        names,
        job=job,
        own_status=lambda: status("healthy", HEAD_NAME),
        log=LOG,
        on_change=lambda: None,
        **kwargs,
    )


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
    peers = head_peers(names, JobDir(tmp_path))
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
    peers = head_peers(names, JobDir(tmp_path))
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
    job, names = job_of_three(tmp_path)
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
    peers = head_peers(names, job, fetch=lambda: ClientFetch(client))
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
    job, names = job_of_three(tmp_path)

    async def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/")[1]
        if request.url.params["after"] != "-1":
            await trio.sleep_forever()  # a long poll: nothing changes
        answer = msgspec.to_builtins(status("healthy", name))
        if name == "decode-1":
            answer["state"] = "exploded"
        return httpx.Response(200, content=msgspec.json.encode(answer))

    peers = head_peers(
        names,
        job,
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
