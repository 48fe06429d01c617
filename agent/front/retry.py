"""Whether a request that failed before its first byte reached the client is tried again.

Retried: the router not reachable (refused, reset, timed out connecting), its 502/503/504, its
429 (TileRT's router says so when no decode is free, or a decode answered ``decode_busy``: its
backpressure, tried again after the router's own pace), and a stream that ended in an error
before its first event. Never retried: any other 4xx (the request itself is wrong), and anything
once a byte reached the client. Each try is bounded by ``agent.front.retry.attempts`` and the
whole request by ``agent.front.retry.budget_s``; waiting for a router being handed over is not a
try (``agent.front.proxy``), nor is a refused connection (no router listens: it died, and the
head restarts it), which is tried again every ``REFUSED_DELAY_S`` within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRIED_STATUS = frozenset({502, 503, 504})
BUSY_STATUS = 429
BUSY_DELAY_S = 0.5  # the router's own pace for a busy decode (it retries a 429 after 0.5 s)
BACKOFF_INITIAL_S = 0.25
BACKOFF_MAX_S = 4.0
REFUSED_DELAY_S = 0.25  # until the head sees the router down (then the try waits for its restart)


@dataclass(frozen=True)
class Failure:
    """One try that gave the client nothing: the router's status (None: no answer) and why."""

    status: int | None
    reason: str  # the retries' label: connect, status_502, busy, stream_error, ...
    message: str
    # The connection was refused: no router listens (not counted against the attempts).
    refused: bool = False


def connect_failure(message: str, *, refused: bool = False) -> Failure:
    """The router could not be reached (``refused``: nothing listens) or dropped the
    connection before answering."""
    return Failure(None, "refused" if refused else "connect", message, refused)


def status_failure(status: int, message: str) -> Failure:
    """The router answered ``status`` (not 200)."""
    reason = "busy" if status == BUSY_STATUS else f"status_{status}"
    return Failure(status, reason, message)


def stream_failure(message: str) -> Failure:
    """The router's stream ended in an error before its first event reached the client."""
    return Failure(502, "stream_error", message)


def stale_failure(message: str) -> Failure:
    """A stream given up before its first event: an engine restarted meanwhile."""
    return Failure(None, "engine_restarted", message)


def retriable(failure: Failure) -> bool:
    """Whether trying again can help."""
    if failure.status is None or failure.status in RETRIED_STATUS:
        return True
    return failure.reason in ("busy", "stream_error")


def backoff_s(failure: Failure, tries: int) -> float:
    """The pause before try ``tries + 1``: the router's pace for busy, else doubling from
    ``BACKOFF_INITIAL_S`` up to ``BACKOFF_MAX_S``."""
    if failure.reason == "busy":
        return BUSY_DELAY_S
    if failure.refused:
        return REFUSED_DELAY_S
    return float(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2.0 ** max(0, tries - 1)))


@dataclass(frozen=True)
class RetryBudget:
    """``agent.front.retry``: tries in all, and seconds from the moment the request is sent."""

    attempts: int
    budget_s: float

    def next_delay(self, failure: Failure, tries: int, elapsed_s: float) -> float | None:
        """The pause before trying again, or None: give up (not retriable, or out of budget)."""
        if not retriable(failure) or (tries >= self.attempts and not failure.refused):
            return None
        delay = backoff_s(failure, tries)
        if elapsed_s + delay >= self.budget_s:
            return None
        return delay
