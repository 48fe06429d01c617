"""The front door's request-level figures (``tilert_front_*``), in the head agent's registry.

Outcomes: ``ok`` (served at the first try), ``retried_ok`` (served after a retry), ``resumed``
(a stream cut after its first byte and continued to its end: ``agent.front.resume``), ``failed``
(the router could not serve it within the retry budget), ``truncated`` (a stream cut after its
first byte and not continued: the client got the error event), ``rejected`` (a 4xx: the request
itself, or no router yet, or the queue's 429), ``cancelled`` (the client went away first). The
queue's own series (``tilert_front_queue_*``) say how many wait for a decode, how long they
waited, and how many were refused by its bounds (``agent.front.admission``). docs/metrics.md
lists the series.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Outcome = Literal["ok", "retried_ok", "resumed", "failed", "truncated", "rejected", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = (
    "ok",
    "retried_ok",
    "resumed",
    "failed",
    "truncated",
    "rejected",
    "cancelled",
)
# The retries' reasons (agent.front.retry): each served from 0; another status adds its own.
REASONS = (
    "connect",
    "refused",
    "status_502",
    "status_503",
    "status_504",
    "busy",
    "stream_error",
    "engine_restarted",
)
QUEUE_REFUSALS = ("full", "wait")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class FrontFigures:
    """Counters, histograms and the in-flight gauge; the tallies ``status`` shows."""

    def __init__(self, registry: CollectorRegistry | None, base: Mapping[str, str]) -> None:
        self.tally: Tally[str] = Tally()
        self.retry_tally: Tally[str] = Tally()
        self.in_flight = 0
        self.queue_waiting = 0
        self.queue_refusals: Tally[str] = Tally()
        names = list(base)
        values = list(base.values())
        self._requests = Counter(
            "tilert_front_requests",
            "Requests at the front door by outcome",
            labelnames=[*names, "outcome"],
            registry=registry,
        )
        self._retries = Counter(
            "tilert_front_retries",
            "Tries again of requests that failed before their first byte, by reason",
            labelnames=[*names, "reason"],
            registry=registry,
        )
        self._ttfb = Histogram(
            "tilert_front_ttfb_seconds",
            "Request arrival to the first byte of the reply sent",
            labelnames=names,
            buckets=BUCKETS,
            registry=registry,
        ).labels(*values)
        self._latency = Histogram(
            "tilert_front_latency_seconds",
            "Request arrival to the reply's last byte sent",
            labelnames=names,
            buckets=BUCKETS,
            registry=registry,
        ).labels(*values)
        self._in_flight = Gauge(
            "tilert_front_in_flight",
            "Requests at the front door not answered yet",
            labelnames=names,
            registry=registry,
        ).labels(*values)
        self._queue_waiting = Gauge(
            "tilert_front_queue_waiting",
            "Requests waiting at the front for a free decode (agent.front.queue)",
            labelnames=names,
            registry=registry,
        ).labels(*values)
        self._queue_wait = Histogram(
            "tilert_front_queue_wait_seconds",
            "Request's wait at the front for a free decode, observed when it was let in",
            labelnames=names,
            buckets=BUCKETS,
            registry=registry,
        ).labels(*values)
        self._queue_rejected = Counter(
            "tilert_front_queue_rejected",
            "Requests answered 429 by the queue's bounds: full (max_waiting), wait (max_wait_s)",
            labelnames=[*names, "reason"],
            registry=registry,
        )
        self._values = values
        for reason in QUEUE_REFUSALS:
            self._queue_rejected.labels(*values, reason)
        for outcome in OUTCOMES:  # every outcome's series from the start: rates need no gap
            self._requests.labels(*values, outcome)
        for reason in REASONS:
            self._retries.labels(*values, reason)

    def started(self) -> None:
        """A request arrived."""
        self.in_flight += 1
        self._in_flight.inc()

    def ended(self, outcome: Outcome, latency_s: float) -> None:
        """A request ended with ``outcome`` after ``latency_s``."""
        self.in_flight -= 1
        self._in_flight.dec()
        self.tally[outcome] += 1
        self._requests.labels(*self._values, outcome).inc()
        self._latency.observe(latency_s)

    def first_byte(self, ttfb_s: float) -> None:
        """The reply's first byte is about to be sent."""
        self._ttfb.observe(ttfb_s)

    def retried(self, reason: str) -> None:
        """A request is tried again after ``reason``."""
        self.retry_tally[reason] += 1
        self._retries.labels(*self._values, reason).inc()

    def queue_length(self, waiting: int) -> None:
        """The number of requests waiting for a decode changed."""
        self.queue_waiting = waiting
        self._queue_waiting.set(waiting)

    def queue_waited(self, seconds: float) -> None:
        """A request was let in after waiting ``seconds``."""
        self._queue_wait.observe(seconds)

    def queue_refused(self, reason: str) -> None:
        """A request was answered 429 by the queue's bound ``reason``."""
        self.queue_refusals[reason] += 1
        self._queue_rejected.labels(*self._values, reason).inc()
