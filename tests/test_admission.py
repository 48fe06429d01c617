"""Admission at the front (agent/front/admission.py) on trio's autojump clock: never more slots
than the router's decodes, one FIFO queue bounded in length and in time, a slot given back on
completion, on a client leaving and on cancellation, the pool growing and shrinking, the
canaries' slots ahead of the queue, and the figures it reports."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from agent.front.admission import (
    Admission,
    NoDecode,
    QueueFull,
    QueueRefused,
    Refusal,
    Slot,
    WaitedTooLong,
)


class Figures:
    """A QueueWatcher that remembers what it was told."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.waits: list[float] = []
        self.refused: list[Refusal] = []

    def queue_length(self, waiting: int) -> None:
        self.lengths.append(waiting)

    def queue_waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def queue_refused(self, reason: Refusal) -> None:
        self.refused.append(reason)


def admission(
    capacity: int | Callable[[], int] = 2,
    *,
    max_waiting: int = 100,
    max_wait_s: float = 60.0,
) -> tuple[Admission, Figures]:
    figures = Figures()
    cap = capacity if callable(capacity) else (lambda: capacity)
    return Admission(cap, max_waiting=max_waiting, max_wait_s=max_wait_s, watcher=figures), figures


async def test_slots_up_to_capacity_then_fifo_order(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """Two slots: the first two go in at once; the next 20 wait and go in in arrival order, one
    each time a slot is released; never more than two held at once."""
    adm, figures = admission(2)
    order: list[int] = []
    most = 0

    async def client(i: int) -> None:
        nonlocal most
        slot = await adm.enter()
        order.append(i)
        most = max(most, adm.admitted)
        await trio.sleep(1.0)
        slot.release()

    async with trio.open_nursery() as nursery:
        for i in range(22):
            nursery.start_soon(client, i)
            await trio.sleep(0.01)  # arrival order is start order
    assert order == list(range(22))
    assert most == 2
    assert adm.admitted == 0
    assert adm.waiting == 0
    assert figures.lengths[-1] == 0
    assert max(figures.lengths) == 20
    assert len(figures.waits) == 22
    assert figures.waits[:2] == [0.0, 0.0]
    assert figures.waits[-1] > 9.0  # the last waited for ten rounds of two


async def test_the_length_bound_refuses_at_once_with_a_retry_after(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """One slot and max_waiting 2: the fourth request is refused at once (QueueFull, 429's
    Retry-After at least 1 s); the waiting ones are served."""
    adm, figures = admission(1, max_waiting=2)
    slot = await adm.enter()
    served: list[int] = []

    async def waiter(i: int) -> None:
        async with adm.slot():
            served.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, 1)
        await trio.sleep(0.01)
        nursery.start_soon(waiter, 2)
        await trio.sleep(0.1)
        assert adm.waiting == 2
        t0 = trio.current_time()
        with pytest.raises(QueueFull) as refused:
            await adm.enter()
        assert trio.current_time() == t0  # at once
        assert refused.value.retry_after_s >= 1
        assert refused.value.reason == "full"
        assert "agent.front.queue.max_waiting" in str(refused.value)
        slot.release()
    assert served == [1, 2]
    assert figures.refused == ["full"]


async def test_no_queue_at_all_with_max_waiting_zero(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """max_waiting 0: a request finding no free slot is refused at once."""
    adm, _ = admission(1, max_waiting=0)
    async with adm.slot():
        with pytest.raises(QueueFull):
            await adm.enter()
    async with adm.slot():
        pass


async def test_the_time_bound_refuses_when_the_wait_exceeds_it(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """max_wait_s 5: a request waiting behind a slot held 10 s is refused after 5 s; it leaves
    the queue, and the one behind it (arrived later) is let in when the slot frees."""
    adm, figures = admission(1, max_wait_s=5.0)
    slot = await adm.enter()
    outcome: dict[str, float] = {}

    async def first() -> None:
        t0 = trio.current_time()
        with pytest.raises(WaitedTooLong) as refused:
            await adm.enter()
        outcome["refused_after"] = trio.current_time() - t0
        assert "agent.front.queue.max_wait_s" in str(refused.value)

    async def second() -> None:
        async with adm.slot():
            outcome["second_in_at"] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.sleep(3.0)
        nursery.start_soon(second)
        await trio.sleep(4.0)  # the first is refused at 5 s; the second waits on (its 4 s)
        assert adm.waiting == 1
        slot.release()
    assert outcome["refused_after"] == pytest.approx(5.0)
    assert outcome["second_in_at"] - start == pytest.approx(7.0)
    assert figures.refused == ["wait"]


async def test_a_client_leaving_the_queue_keeps_the_order_and_takes_no_slot(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """Three wait; the middle one's client leaves (cancelled): the others go in in order, the
    slot count is right afterwards."""
    adm, figures = admission(1)
    slot = await adm.enter()
    order: list[str] = []
    left = trio.CancelScope()

    async def waiter(name: str) -> None:
        async with adm.slot():
            order.append(name)
            await trio.sleep(1.0)

    async def leaver() -> None:
        with left:
            await waiter("b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "a")
        await trio.sleep(0.1)
        nursery.start_soon(leaver)
        await trio.sleep(0.1)
        nursery.start_soon(waiter, "c")
        await trio.sleep(0.1)
        assert adm.waiting == 3
        left.cancel()
        await trio.sleep(0.1)
        assert adm.waiting == 2
        assert figures.lengths[-1] == 2
        slot.release()
    assert order == ["a", "c"]
    assert adm.admitted == 0
    assert adm.waiting == 0


async def test_cancelled_the_moment_it_was_let_in_gives_the_slot_back(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """A waiter let in (its slot counted) but cancelled before it ran: the slot goes to the
    next waiter, none is lost."""
    adm, _ = admission(1)
    slot = await adm.enter()
    got: list[str] = []
    scope = trio.CancelScope()

    async def doomed() -> None:
        with scope:
            await adm.enter()
            got.append("doomed")  # never: it was cancelled in the step it was let in

    async def next_one() -> None:
        async with adm.slot():
            got.append("next")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(doomed)
        await trio.sleep(0.1)
        nursery.start_soon(next_one)
        await trio.sleep(0.1)
        scope.cancel()  # ``doomed`` is cancelled ...
        slot.release()  # ... and let in before it runs: its slot must go to the next
    assert got == ["next"]
    assert adm.admitted == 0


async def test_a_slot_released_twice_counts_once(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    adm, _ = admission(2)
    slot = await adm.enter()
    other = await adm.enter()
    slot.release()
    slot.release()
    assert adm.admitted == 1
    other.release()
    assert adm.admitted == 0


async def test_capacity_grows_and_shrinks_with_the_pool(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """Capacity 1 -> 3 (decodes joined: ``changed`` lets two more in at once) -> 1 (two left:
    nobody goes in until the slots held are below it again)."""
    pool = {"decodes": 1}
    adm, _ = admission(lambda: pool["decodes"])
    held: list[Slot] = [await adm.enter()]
    let_in: list[int] = []

    async def waiter(i: int) -> None:
        held.append(await adm.enter())
        let_in.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(waiter, i)
            await trio.sleep(0.01)  # arrival order is start order
        await trio.sleep(1.0)
        assert let_in == []
        pool["decodes"] = 3
        adm.changed()
        await trio.sleep(0.1)
        assert sorted(let_in) == [0, 1]  # let in at once: they run in any order
        assert adm.admitted == 3
        pool["decodes"] = 1
        adm.changed()
        held.pop(0).release()
        held.pop(0).release()
        await trio.sleep(0.1)
        assert len(let_in) == 2  # 1 held, capacity 1: the queue waits
        held.pop(0).release()
        await trio.sleep(0.1)
        assert let_in[2:] == [2]
        held.pop(0).release()
    assert let_in[2:] == [2, 3]


async def test_no_decode_no_admission_until_one_joins(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """Capacity 0 (every decode out of the router's list): requests wait, bounded."""
    pool = {"decodes": 0}
    adm, _ = admission(lambda: pool["decodes"], max_wait_s=10.0)
    with pytest.raises(NoDecode) as info:  # no decode at all: 503, not busy's 429
        await adm.enter()
    assert info.value.status == 503
    async with trio.open_nursery() as nursery:

        async def later() -> None:
            await trio.sleep(2.0)
            pool["decodes"] = 1
            adm.changed()

        nursery.start_soon(later)
        async with adm.slot():
            assert trio.current_time() >= 12.0


async def test_canaries_go_ahead_of_the_queue_and_are_never_refused(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """A full queue (max_waiting 1): a canary (``first``) still waits, at its head, and is let
    in at the next free slot; the waiting request after it; no wait bound applies to it."""
    adm, _ = admission(1, max_waiting=1, max_wait_s=5.0)
    slot = await adm.enter()
    order: list[str] = []

    async def user() -> None:
        try:
            async with adm.slot():
                order.append("user")
        except QueueRefused:
            order.append("user refused")

    async def canary() -> None:
        async with adm.slot(first=True):
            order.append("canary")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(user)
        await trio.sleep(0.1)
        nursery.start_soon(canary)
        await trio.sleep(0.1)
        assert adm.waiting == 2
        await trio.sleep(4.0)
        slot.release()
    assert order == ["canary", "user"]


async def test_retry_after_follows_the_queue_and_the_hold_time(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    """Retry-After grows with the queue per decode and with how long slots are held, within
    1-60 s."""
    adm, _ = admission(2, max_waiting=1000)
    assert 1 <= adm.retry_after_s() <= 60
    for _ in range(60):  # slots held 4 s each
        async with adm.slot():
            await trio.sleep(4.0)
    assert adm.retry_after_s() == 2  # 4 s per slot x 1 / 2 decodes
    held = [await adm.enter(), await adm.enter()]
    async with trio.open_nursery() as nursery:
        for _ in range(9):
            nursery.start_soon(adm.enter)
        await trio.sleep(0.1)
        assert adm.waiting == 9
        assert adm.retry_after_s() == 20  # 4 s x 10 / 2
        assert adm.oldest_wait_s() == pytest.approx(0.1)
        nursery.cancel_scope.cancel()
    for slot in held:
        slot.release()
    assert adm.admitted == 0
