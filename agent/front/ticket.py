"""One request at the front door, from its arrival to its last byte: the one place its outcome,
its timings and its figures are counted, and its slot at the router given back.

``Front`` makes a ``Ticket`` the moment a request arrives (``tilert_front_in_flight`` counts it).
Whatever answers the request ends its ticket with an outcome (``agent.front.figures``): a refusal
or the router's whole reply at once (``answer``), a stream when its relay ends, a request whose
client left (or whose handler failed) as ``cancelled``. Only the first end counts: a ``finally``
that ends it again after its outcome was known changes nothing. The first byte is counted once, as
the reply is about to be sent (a stream's at its first content); each try again as the proxy makes
it, and a served request's outcome says whether it was tried again (``served``).
"""

from __future__ import annotations

from typing import Protocol

import trio

from agent.front.figures import Outcome
from agent.web.asgi import Response


class Counted(Protocol):
    """Where a ticket counts its request: ``agent.front.figures.FrontFigures`` (the front door),
    or the service front's figures at the request's cell (``agent.service.front``)."""

    def started(self) -> None:
        """A request arrived."""

    def retried(self, reason: str) -> None:
        """The request is tried again after ``reason``."""

    def first_byte(self, ttfb_s: float) -> None:
        """The reply's first byte is about to be sent."""

    def ended(self, outcome: Outcome, latency_s: float) -> None:
        """The request ended with ``outcome`` after ``latency_s``."""


class Held(Protocol):
    """What a let-in request holds until it ends: its ``agent.front.admission.Slot`` (and, at
    the service front, its place at a cell)."""

    def release(self) -> None:
        """Give it back (idempotent, synchronous)."""


class Ticket:
    """One request's life at the front: counted in, counted out once."""

    def __init__(self, figures: Counted) -> None:
        self.figures = figures
        self.arrived = trio.current_time()
        self.retries = 0
        self.slot: Held | None = None  # the request's slot at the router, once let in
        self.outcome: Outcome | None = None  # once ended
        self._first_byte = False
        figures.started()

    def elapsed_s(self) -> float:
        """Seconds since the request arrived."""
        return trio.current_time() - self.arrived

    def hold(self, slot: Held) -> None:
        """The request was let in: ``slot`` is given back when it ends."""
        self.slot = slot

    def retried(self, reason: str) -> None:
        """The request is tried again at the router after ``reason`` (``agent.front.retry``)."""
        self.retries += 1
        self.figures.retried(reason)

    def served(self) -> Outcome:
        """The outcome of a reply the router gave: at the first try, or after tries again."""
        return "retried_ok" if self.retries else "ok"

    def first_byte(self) -> None:
        """The reply's first byte is about to be sent (counted once)."""
        if not self._first_byte:
            self._first_byte = True
            self.figures.first_byte(self.elapsed_s())

    def end(self, outcome: Outcome) -> None:
        """The request ended with ``outcome``: its slot given back, its end counted (the first
        end only: synchronous, so safe in a ``finally`` under cancellation)."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release()
        if self.outcome is None:
            self.outcome = outcome
            self.figures.ended(outcome, self.elapsed_s())

    def answer(self, response: Response, outcome: Outcome) -> Response:
        """A whole reply, ``response``: its first byte and its end, now."""
        self.first_byte()
        self.end(outcome)
        return response
