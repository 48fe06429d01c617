"""The chaos benchmark's pure parts (tests/bench/chaosplan.py): its faults, its schedule, and
what it charges to each fault. No process: requests and faults are data."""

from __future__ import annotations

import pytest

from tests.bench.chaosplan import (
    BadFault,
    Fault,
    Request,
    Schedule,
    Struck,
    account,
    buckets,
    parse_faults,
    render,
)


def test_faults_parse_in_order_with_their_targets() -> None:
    faults = parse_faults(
        "decode-engine:decode-0, router,scale:4,prefill-engine,decode-agent:decode-1"
    )
    assert [f.label for f in faults] == [
        "decode-engine:decode-0",
        "router",
        "scale:4",
        "prefill-engine",
        "decode-agent:decode-1",
    ]
    assert faults[0].kills_a_decode
    assert faults[4].kills_a_decode
    assert faults[1].kills_the_path
    assert faults[3].kills_the_path
    assert not faults[2].kills_a_decode
    assert not faults[2].kills_the_path


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("router,reboot", "unknown fault 'reboot'"),
        ("decode-engine", "names no decode"),
        ("decode-agent:prefill-0", "names no decode"),
        ("scale:0", "decode count >= 1"),
        ("scale:many", "decode count >= 1"),
        ("router:decode-0", "takes no target"),
        (" , ", "no fault given"),
    ],
)
def test_a_bad_fault_is_named(text: str, said: str) -> None:
    with pytest.raises(BadFault, match=said):
        parse_faults(text)


def test_the_schedule_goes_round_while_time_is_left() -> None:
    schedule = Schedule(parse_faults("router,scale:4"), duration_s=100, reserve_s=20)
    assert schedule.next(0).label == "router"  # type: ignore[union-attr]
    assert schedule.next(50).label == "scale:4"  # type: ignore[union-attr]
    assert schedule.next(79).label == "router"  # type: ignore[union-attr]  # round two
    assert schedule.next(81) is None  # no room left for another
    # The first fault always strikes, whatever the duration.
    assert Schedule(parse_faults("router"), duration_s=1, reserve_s=20).next(0) is not None


def ok(start: float, end: float, retries: int = 0) -> Request:
    return Request(start, end, "ok", start + 0.1, retries)


def test_a_request_belongs_to_the_last_fault_before_it_ended() -> None:
    struck = [Struck(Fault("router"), at=10), Struck(Fault("scale", "4"), at=20)]
    before, during_first, during_second = (
        ok(1, 5),
        ok(9, 11),  # in flight when the router died
        ok(15, 21),  # in flight when scale began
    )
    grouped = list(buckets([before, during_first, during_second, ok(22, 23)], struck))
    assert grouped == [[before], [during_first], [during_second, ok(22, 23)]]


def test_a_decode_kill_may_truncate_only_what_was_in_flight_and_visibly() -> None:
    struck = [Struck(Fault("decode-engine", "decode-0"), at=10, ready_at=12)]
    requests = [
        ok(1, 2),
        Request(9, 10.5, "truncated", 9.1, error="stream_truncated"),  # streaming at the kill
        ok(10.2, 13, retries=2),
    ]
    base, cost = account(requests, struck, bound_s=60)
    assert (base.requests, base.misses) == (1, [])
    assert (cost.requests, cost.ok, cost.truncated, cost.lost, cost.in_flight) == (2, 1, 1, 0, 1)
    assert (cost.client_retries, cost.ready_s, cost.misses) == (2, 2, [])
    assert cost.slowest_s == pytest.approx(2.8)  # the retried one
    # One that started after the kill and was truncated is a miss; so is a silent cut.
    late = [*requests, Request(11, 11.5, "truncated", 11.1), Request(11, 12, "cut", 11.1)]
    cost = account(late, struck, bound_s=60)[1]
    assert cost.misses == [
        "decode-engine:decode-0: 1 stream(s) cut silently (no error event)",
        "decode-engine:decode-0: 1 truncated, not in flight",
    ]
    assert cost.lost == 1  # the cut


def test_lost_requests_and_no_ready_are_misses() -> None:
    struck = [Struck(Fault("scale", "3"), at=10, ready_at=None)]
    failed = Request(11, 12, "failed", None, error="HTTP 502")
    cost = account([failed], struck, bound_s=90)[1]
    assert cost.misses == ["scale:3: 1 request(s) lost", "scale:3: not ready again within 90 s"]
    assert cost.errors == ["HTTP 502"]
    assert "scale:3" in render([cost])
    assert " no" in render([cost])


def test_a_prefill_or_router_kill_loses_at_most_what_was_in_flight() -> None:
    struck = [Struck(Fault("prefill-engine"), at=10, ready_at=15)]
    flying = [Request(9, 10.1, "failed", 9.1), Request(9.5, 10.2, "truncated", 9.6)]
    assert account(flying, struck, bound_s=60)[1].misses == []
    after = [*flying, Request(11, 11.5, "failed", None)]
    assert account(after, struck, bound_s=60)[1].misses == [
        "prefill-engine: 3 lost or truncated, more than the 2 in flight when it struck"
    ]


def test_the_baseline_loses_nothing() -> None:
    base = account([Request(1, 2, "failed", None)], [], bound_s=60)[0]
    assert base.misses == ["baseline: 1 request(s) lost"]


def test_with_resume_a_decode_kill_may_truncate_nothing_and_resumed_streams_are_shown() -> None:
    struck = [Struck(Fault("decode-engine", "decode-0"), 10, 12, 1.0, {"resumed": 2.0})]
    flying = [Request(9, 10.5, "truncated", 9.1, error="stream_truncated"), ok(9, 11)]
    assert account(flying, struck, bound_s=60)[1].misses == []
    cost = account(flying, struck, bound_s=60, resume=True)[1]
    assert cost.misses == [
        "decode-engine:decode-0: 1 truncated, with the front continuing cut streams"
    ]
    assert cost.resumed == 2
    table = render([cost]).splitlines()
    assert table[1].split()[table[0].split().index("resumed")] == "2"
