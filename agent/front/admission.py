"""Admission at the front: never more requests at the router than it has decodes; the rest wait
in one FIFO queue, bounded in length and in time (``agent.front.queue``).

A TileRT decode serves one request at a time and TileRT's router hands each request to a free
decode, or (with ``--queue-timeout``) blocks one of its 40 threads waiting for one: threads its
``/health`` needs too. So the front holds what the router cannot serve at once: a request gets a
*slot* (one of ``capacity()``, the decodes in the router's list) before it is sent and keeps it
through its retries and through a wait for a router hand-over, until its reply's last byte came
from the router (the router has freed the decode by then). The others wait in arrival order and
each is let in the moment a slot frees (``release``) or the pool grows (``changed``): an event per
waiter, nothing polled. Past ``max_waiting`` waiting a request is refused at once (``QueueFull``),
past ``max_wait_s`` waited it is refused then (``WaitedTooLong``); both are answered 429 with
Retry-After. A client that leaves while waiting leaves the queue; one cancelled the moment it was
let in gives its slot back.

The head's canaries go to the router directly, not through the front; they take slots here
(``first=True``: ahead of the queue, never refused) so a canary finds a free decode and the front
sends no more than the decodes left.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal, Protocol

import trio

from agent.errors import RuntimeFailure

# A slot's mean hold time before any was seen (the Retry-After estimate's start), and how fast
# the estimate follows new ones (an exponentially weighted mean).
FIRST_HOLD_S = 2.0
HOLD_WEIGHT = 0.1
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60

Refusal = Literal["full", "wait"]


class QueueRefused(RuntimeFailure):
    """Past the queue's bound: answered ``status`` (429) with ``retry_after_s``."""

    reason: Refusal = "full"
    status = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(QueueRefused):
    """``max_waiting`` requests wait already."""

    reason: Refusal = "full"


class WaitedTooLong(QueueRefused):
    """The request waited ``max_wait_s`` without a free decode."""

    reason: Refusal = "wait"


class NoDecode(WaitedTooLong):
    """The request waited ``max_wait_s`` and the router's list held no decode at all: answered
    503, not 429 (429 says every decode is busy; here none serves)."""

    status = 503


class QueueWatcher(Protocol):
    """What the queue tells its figures (``agent.front.figures``)."""

    def queue_length(self, waiting: int) -> None:
        """The number of requests waiting changed."""

    def queue_waited(self, seconds: float) -> None:
        """A request was let in after waiting ``seconds``."""

    def queue_refused(self, reason: Refusal) -> None:
        """A request was refused (``full`` at once, ``wait`` past the time bound)."""


class _Waiter:
    __slots__ = ("admitted", "event", "since")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.admitted = False
        self.since = trio.current_time()


class Slot:
    """One admitted request's slot: ``release`` it once the router is done with the request
    (idempotent, synchronous: safe in a ``finally`` under cancellation)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._since = trio.current_time()

    def release(self) -> None:
        """Give the slot back: the next waiter goes in."""
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._free(trio.current_time() - self._since)


class Admission:
    """The front's slots and its one FIFO queue (pure trio: no I/O)."""

    def __init__(
        self,
        capacity: Callable[[], int],
        *,
        max_waiting: int,
        max_wait_s: float,
        watcher: QueueWatcher | None = None,
    ) -> None:
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.watcher = watcher
        self.admitted = 0  # slots held (requests at the router, canaries among them)
        self._queue: deque[_Waiter] = deque()
        self._hold_s = FIRST_HOLD_S

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._queue)

    def oldest_wait_s(self) -> float:
        """How long the request at the queue's head has waited (0 with none waiting)."""
        return trio.current_time() - self._queue[0].since if self._queue else 0.0

    def retry_after_s(self) -> int:
        """A client's pause before trying again: about when the queue has moved past it now."""
        per_slot = self._hold_s * (self.waiting + 1) / max(1, self.capacity())
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(per_slot))))

    def changed(self) -> None:
        """The pool may have changed (a decode joined, left, rested): let in whom it allows."""
        self._admit()

    async def enter(self, *, first: bool = False) -> Slot:
        """A slot, once free; waits in the queue (``first``: at its head, never refused, no
        time bound: the caller bounds it). ``QueueRefused`` past the bounds."""
        if not self._queue and self.admitted < self.capacity():
            return self._grant()
        if not first and self.waiting >= self.max_waiting:
            self._refused("full")
            raise QueueFull(
                f"{self.waiting} requests wait for a decode already "
                "(agent.front.queue.max_waiting)",
                self.retry_after_s(),
            )
        waiter = _Waiter()
        if first:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        self._length()
        try:
            with trio.move_on_after(math.inf if first else self.max_wait_s):
                await waiter.event.wait()
        except BaseException:  # the client left (or the front stops) while it waited
            if waiter.admitted:
                self.admitted -= 1  # let in the moment it left: the slot goes to the next
                self._admit()
            else:
                self._leave(waiter)
            raise
        if not waiter.admitted:
            self._leave(waiter)
            self._refused("wait")
            if self.capacity() == 0:
                raise NoDecode(
                    f"no decode was in the router's pool within {self.max_wait_s:g} s "
                    "(agent.front.queue.max_wait_s)",
                    self.retry_after_s(),
                )
            raise WaitedTooLong(
                f"no decode was free within {self.max_wait_s:g} s (agent.front.queue.max_wait_s)",
                self.retry_after_s(),
            )
        if self.watcher is not None:
            self.watcher.queue_waited(trio.current_time() - waiter.since)
        return Slot(self)

    @asynccontextmanager
    async def slot(self, *, first: bool = False) -> AsyncIterator[Slot]:
        """``enter`` and ``release`` around a block."""
        held = await self.enter(first=first)
        try:
            yield held
        finally:
            held.release()

    def _grant(self) -> Slot:
        self.admitted += 1
        if self.watcher is not None:
            self.watcher.queue_waited(0.0)
        return Slot(self)

    def _free(self, held_s: float) -> None:
        self.admitted -= 1
        self._hold_s += HOLD_WEIGHT * (held_s - self._hold_s)
        self._admit()

    def _admit(self) -> None:
        """Let in the waiters at the queue's head while slots are free."""
        moved = False
        while self._queue and self.admitted < self.capacity():
            waiter = self._queue.popleft()
            waiter.admitted = True
            self.admitted += 1
            waiter.event.set()
            moved = True
        if moved:
            self._length()

    def _leave(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        self._length()

    def _length(self) -> None:
        if self.watcher is not None:
            self.watcher.queue_length(self.waiting)

    def _refused(self, reason: Refusal) -> None:
        if self.watcher is not None:
            self.watcher.queue_refused(reason)
