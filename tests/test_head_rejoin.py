"""Rejoin on data alone: which dropped decode comes back, which stays out, and how a peer that was
taken as failed (lost, or its agent exited) comes back to the head.

No process, socket or job: the decisions read a ``JobView`` built here (tests/test_head.py's
helpers), and ``Peer`` is fed answers and records by hand.
"""

from __future__ import annotations

import msgspec

from agent.head.decisions import fatal, held_out, serving_state, to_drop, to_rejoin
from agent.head.peers import UNREACHABLE_FAIL_S, Peer
from agent.job.records import AgentExit
from tests.test_head import record, state_of, status, view

FAILED_ONCE = {"decode-1": "decode-1 on node-decode-1 failed: boom (log: x)"}


def test_a_dropped_decode_healthy_again_is_taken_back() -> None:
    assert to_rejoin(view(), FAILED_ONCE, {}, max_rejoins=3) == ["decode-1"]
    assert to_rejoin(view(), FAILED_ONCE, {"decode-1": 2}, max_rejoins=3) == ["decode-1"]
    assert held_out(view(), FAILED_ONCE, {"decode-1": 2}, max_rejoins=3) == {}


def test_a_dropped_decode_not_healthy_is_not_taken_back() -> None:
    for state in ("failed", "starting", "restarting", "unreachable", "missing", "stopped"):
        v = view({"decode-1": state})
        assert to_rejoin(v, FAILED_ONCE, {}, max_rejoins=3) == [], state
        assert held_out(v, FAILED_ONCE, {}, max_rejoins=3) == {}, state


def test_only_dropped_decodes_rejoin() -> None:
    assert to_rejoin(view(), {}, {}, max_rejoins=3) == []
    # The prefill is never dropped, so never taken back either.
    assert to_rejoin(view(), {"prefill-0": "x"}, {}, max_rejoins=3) == []


def test_a_decode_that_flapped_past_its_bound_stays_out_with_the_reason() -> None:
    rejoins = {"decode-1": 3}
    assert to_rejoin(view(), FAILED_ONCE, rejoins, max_rejoins=3) == []
    why = held_out(view(), FAILED_ONCE, rejoins, max_rejoins=3)["decode-1"]
    assert "kept out of the router" in why
    assert "taken back 3 time(s)" in why
    assert "agent.max_rejoins (3)" in why
    # It stays dropped: the job serves degraded through the others, and is not failed.
    state, reason = serving_state(view(), FAILED_ONCE)
    assert (state, "decode-1 dropped" in reason) == ("degraded", True)
    assert fatal(view()) is None


def test_max_rejoins_zero_means_never_back() -> None:
    assert to_rejoin(view(), FAILED_ONCE, {}, max_rejoins=0) == []
    assert "agent.max_rejoins (0)" in held_out(view(), FAILED_ONCE, {}, max_rejoins=0)["decode-1"]


def test_a_rejoined_decode_that_fails_again_is_dropped_again() -> None:
    # Taken back (no longer in ``dropped``), then failed: dropped like any failed decode.
    assert to_drop(view({"decode-1": "failed"}), dropped={}) == ["decode-1"]


def test_a_lost_peer_that_answers_again_is_what_it_says() -> None:
    peer = Peer(record=record("decode-1"))
    peer.observe(status("healthy", "decode-1"), now=0.0)
    for i, now in enumerate((10.0, 10.2, 10.0 + UNREACHABLE_FAIL_S)):
        peer.unanswered("connection refused", now=now + i * 0.001)
    assert state_of(peer) == "failed"
    assert peer.observe(status("healthy", "decode-1"), now=30.0) is True
    assert (state_of(peer), peer.lost, peer.healthy_seen_at) == ("healthy", None, 30.0)


def test_an_answer_that_changed_nothing_does_not_wake_the_head() -> None:
    peer = Peer(record=record("decode-1"))
    assert peer.observe(status("healthy", "decode-1"), now=0.0) is True
    # The long poll's timeout answered with the same status; only the uptime moved.
    again = msgspec.structs.replace(status("healthy", "decode-1"), uptime_s=42.0)
    assert peer.observe(again, now=5.0) is False
    assert peer.observe(status("restarting", "decode-1"), now=6.0) is True


def test_a_new_record_after_the_last_word_is_a_new_agent() -> None:
    old = record("decode-1")
    old.updated_at = 1.0
    old.exited = AgentExit(state="failed", reason="engine failed", code=1, at=1.0)
    peer = Peer(record=old)
    peer.observe(status("failed", "decode-1"), now=0.0)
    new = record("decode-1")
    new.updated_at = 2.0
    assert peer.reborn(new) is True
    peer.record = new
    assert (state_of(peer), peer.status) == ("starting", None)  # waiting for its first answer


def test_a_republished_record_of_a_live_agent_is_not_a_new_agent() -> None:
    old = record("decode-1")
    old.updated_at = 1.0
    peer = Peer(record=old)
    peer.observe(status("healthy", "decode-1"), now=0.0)
    moved = record("decode-1")
    moved.updated_at = 2.0
    assert peer.reborn(moved) is False
    assert peer.status is not None
    # The same record read again (a full pass of the folder) is nothing new either.
    assert peer.reborn(old) is False
