"""A decode the agents know to be down leaves the router's list after
``agent.down_decode_out_after_s`` and comes back once healthy (agent/head/decisions.py: the
pure decisions, driven with data)."""

from __future__ import annotations

from agent.head.decisions import JobView, down_decodes, router_list, to_rest, to_wake
from agent.job.vocab import AgentState
from tests.test_head import view as job_view

IN_ROUTER = ["decode-0", "decode-1", "decode-2"]


def view(states: dict[str, AgentState]) -> JobView:
    """prefill-0 and three decodes, healthy unless ``states`` says."""
    return job_view(states, decodes=3)


def test_down_means_restarting_starting_unhealthy_or_unreachable() -> None:
    states: dict[str, AgentState] = {
        "decode-0": "restarting",
        "decode-1": "unreachable",
        "decode-2": "failed",  # dropped by to_drop, not rested
        "prefill-0": "restarting",  # not a decode
    }
    assert down_decodes(view(states), IN_ROUTER) == ["decode-0", "decode-1"]
    assert down_decodes(view({"decode-0": "starting"}), ["decode-1"]) == []  # not in the list
    assert down_decodes(view({"decode-2": "unhealthy"}), IN_ROUTER) == ["decode-2"]


def test_a_decode_down_long_enough_leaves_the_list() -> None:
    since = {"decode-0": 10.0, "decode-1": 11.5}
    assert to_rest(since, IN_ROUTER, now=11.9, after_s=2.0) == []
    assert to_rest(since, IN_ROUTER, now=12.0, after_s=2.0) == ["decode-0"]
    assert to_rest(since, IN_ROUTER, now=13.5, after_s=2.0) == ["decode-0", "decode-1"]
    assert to_rest(since, IN_ROUTER, now=10.0, after_s=0.0) == ["decode-0"]  # at once


def test_never_when_the_key_is_null() -> None:
    assert to_rest({"decode-0": 0.0}, IN_ROUTER, now=1e6, after_s=None) == []


def test_the_last_decode_of_the_list_stays() -> None:
    since = {n: 0.0 for n in IN_ROUTER}
    assert to_rest(since, IN_ROUTER, now=5.0, after_s=1.0) == ["decode-0", "decode-1"]
    assert to_rest({"decode-2": 0.0}, ["decode-2"], now=5.0, after_s=1.0) == []


def test_a_resting_decode_comes_back_once_healthy() -> None:
    resting = {"decode-0", "decode-1"}
    v = view({"decode-0": "starting"})
    assert to_wake(v, resting) == ["decode-1"]
    assert to_wake(view({}), resting) == ["decode-0", "decode-1"]
    assert to_wake(view({}), set()) == []


def test_the_router_list_is_the_members_neither_dropped_nor_resting() -> None:
    # One definition of the list (agent.head.poolkeeper hands it to the router): listing order.
    members = ["decode-0", "decode-1", "decode-2", "decode-10"]
    assert router_list(members, {}, set()) == members
    assert router_list(members, {"decode-1": "why"}, {"decode-10"}) == ["decode-0", "decode-2"]
    assert router_list(members, (), members) == []
