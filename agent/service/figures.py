"""Every ``tilert_service_*`` series, in the service front's own registry (its ``/metrics``).

The control plane (the cell keeper) says the cells by state, the successions and the
replacements; the data plane (``agent.service.front``, ``agent.service.cellslots``) counts the
requests by outcome and by cell, each cell's requests in flight and ready decodes, the tries
again, the one FIFO queue (its length, its waits, its refusals), the time to a first byte and to
the last. Outcomes are the front door's (``agent.front.figures.OUTCOMES``); a request that never
reached a cell is counted at the cell ``none``. docs/metrics.md lists the series.
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections.abc import Mapping
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from agent.front.admission import Refusal
from agent.front.figures import BUCKETS, OUTCOMES, QUEUE_REFUSALS, REASONS, Outcome
from agent.service.records import CellState

CELL_STATES: tuple[CellState, ...] = get_args(CellState)
# The ``cell`` label of a request no cell took (refused, or answered before it was let in).
NO_CELL = "none"
# A request cut before its first byte because its cell failed, tried again at another cell.
CELL_CUT = "cell_cut"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServiceFigures:
    """The service front's series and the tallies ``service.json`` carries."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # (outcome, cell) -> requests ended since this front started.
        self.tally: Tally[tuple[str, str]] = Tally()
        self.in_flight = 0
        registry = self.registry
        self._cells = Gauge(
            "tilert_service_cells", "Cells of the service by state", ["state"], registry=registry
        )
        self._successions = Counter(
            "tilert_service_successions",
            "Cells retired because a successor took their place",
            registry=registry,
        )
        self._replacements = Counter(
            "tilert_service_replacements",
            "Cells submitted in place of a failed one",
            registry=registry,
        )
        self._requests = Counter(
            "tilert_service_requests",
            "Requests at the service front by outcome and by the cell that took them",
            ["outcome", "cell"],
            registry=registry,
        )
        self._requests_in_flight = Gauge(
            "tilert_service_requests_in_flight",
            "Requests at the service front not answered yet (waiting ones among them)",
            registry=registry,
        )
        self._cell_in_flight = Gauge(
            "tilert_service_cell_in_flight",
            "Requests of the service front at each cell now",
            ["cell"],
            registry=registry,
        )
        self._cell_decodes = Gauge(
            "tilert_service_cell_decodes",
            "Ready decodes of each cell taking new requests (0: it takes none)",
            ["cell"],
            registry=registry,
        )
        self._retries = Counter(
            "tilert_service_retries",
            "Tries again at another cell of requests that failed before their first byte",
            ["reason"],
            registry=registry,
        )
        self._queue_waiting = Gauge(
            "tilert_service_queue_waiting",
            "Requests waiting at the service front for a free decode in any cell",
            registry=registry,
        )
        self._queue_rejected = Counter(
            "tilert_service_queue_rejected",
            "Requests refused by the queue's bounds: full (max_waiting), wait (max_wait_s)",
            ["reason"],
            registry=registry,
        )
        self._timings(registry)
        self._known: set[str] = set()
        self.cells({})
        for reason in QUEUE_REFUSALS:
            self._queue_rejected.labels(reason)
        for reason in (*REASONS, CELL_CUT):
            self._retries.labels(reason)
        self._cell_series(NO_CELL)

    def _timings(self, registry: CollectorRegistry) -> None:
        """The histograms: the queue's waits, the first byte's and the last byte's times."""
        self._queue_wait = Histogram(
            "tilert_service_queue_wait_seconds",
            "Request's wait at the service front for a free decode, observed when let in",
            buckets=BUCKETS,
            registry=registry,
        )
        self._ttfb = Histogram(
            "tilert_service_ttfb_seconds",
            "Request arrival at the service front to the first byte of its reply sent",
            buckets=BUCKETS,
            registry=registry,
        )
        self._latency = Histogram(
            "tilert_service_latency_seconds",
            "Request arrival at the service front to its reply's last byte sent",
            buckets=BUCKETS,
            registry=registry,
        )

    # ---- the control plane's ----------------------------------------------------------------

    def cells(self, states: Mapping[str, int]) -> None:
        """The cells by state now (a state missing: 0)."""
        for state in {*CELL_STATES, *states}:
            self._cells.labels(state).set(states.get(state, 0))

    def succession(self) -> None:
        """A cell was retired: its successor took its place."""
        self._successions.inc()

    def replacement(self) -> None:
        """A cell was submitted in place of a failed one."""
        self._replacements.inc()

    # ---- the data plane's -------------------------------------------------------------------

    def cell_load(self, cell: str, in_flight: int, decodes: int) -> None:
        """Cell ``cell`` has ``in_flight`` requests of ours and takes new ones on ``decodes``."""
        self._cell_series(cell)
        self._cell_in_flight.labels(cell).set(in_flight)
        self._cell_decodes.labels(cell).set(decodes)

    def cell_gone(self, cell: str) -> None:
        """Cell ``cell`` left the table with nothing in flight: its gauges go (its request
        counts stay, as counters do)."""
        for gauge in (self._cell_in_flight, self._cell_decodes):
            with contextlib.suppress(KeyError):
                gauge.remove(cell)

    def _cell_series(self, cell: str) -> None:
        if cell not in self._known:
            self._known.add(cell)
            for outcome in OUTCOMES:  # every outcome's series from the start: rates need no gap
                self._requests.labels(outcome, cell)

    def started(self) -> None:
        """A request arrived."""
        self.in_flight += 1
        self._requests_in_flight.inc()

    def ended(self, outcome: Outcome, cell: str, latency_s: float) -> None:
        """A request ended with ``outcome`` at ``cell`` (``NO_CELL``: none took it)."""
        self.in_flight -= 1
        self._requests_in_flight.dec()
        self.tally[(outcome, cell)] += 1
        self._cell_series(cell)
        self._requests.labels(outcome, cell).inc()
        self._latency.observe(latency_s)

    def first_byte(self, ttfb_s: float) -> None:
        """A reply's first byte is about to be sent."""
        self._ttfb.observe(ttfb_s)

    def retried(self, reason: str) -> None:
        """A request is tried again (at another cell when there is one) after ``reason``."""
        self._retries.labels(reason).inc()

    def queue_length(self, waiting: int) -> None:
        """The number of requests waiting for a free decode changed."""
        self._queue_waiting.set(waiting)

    def queue_waited(self, seconds: float) -> None:
        """A request was let in after waiting ``seconds``."""
        self._queue_wait.observe(seconds)

    def queue_refused(self, reason: Refusal) -> None:
        """A request was refused by the queue's bound ``reason``."""
        self._queue_rejected.labels(reason).inc()

    def page(self) -> bytes:
        """The ``/metrics`` page (Prometheus' text format, ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
