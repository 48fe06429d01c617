"""Waiting: every wait polls the condition itself, is bounded, and names what it awaited.

A test never sleeps for something to happen: it waits for the thing (a state, a file, a line, a
process gone) with a deadline, and a timeout fails saying what was awaited and what was seen
last. These waits are for real processes and sockets, whose time is real; a unit test that waits
out a product timeout runs on trio's clock instead (pytest-trio's ``autojump_clock`` fixture), so
no real time passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import trio

T = TypeVar("T")

POLL_S = 0.05
# What a probe may raise while the awaited thing is not there yet: a server not listening yet, a
# file not written yet or half-written.
NOT_YET = (httpx.HTTPError, OSError, ValueError)


def wait_for(
    what: str,
    probe: Callable[[], T],
    timeout: float,
    *,
    until: Callable[[T], Any] = bool,
    interval: float = POLL_S,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until ``until(value)`` holds (by default: until the value is truthy) and
    return that value; after ``timeout`` seconds fail naming ``what``, the last value and
    ``detail()``. A probe that raises one of ``NOT_YET`` counts as not yet; an AssertionError
    from it fails the wait at once (a process that exited, say)."""
    deadline = time.monotonic() + timeout
    last: Any = "(no answer yet)"
    while True:
        with contextlib.suppress(*NOT_YET):
            value = probe()
            last = value
            if until(value):
                return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what} (last: {last!r}){extra}"
            )
        time.sleep(interval)


@contextlib.contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """``trio.fail_after(seconds)`` for an async test's wait, failing with a message naming
    ``what`` instead of a bare TooSlowError."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        raise AssertionError(f"timed out after {seconds:g}s waiting for {what}") from None


async def until(
    condition: Callable[[], object], what: str, limit_s: float = 10.0, poll_s: float = 0.02
) -> None:
    """Wait in trio code until ``condition()`` is true, polling it (it reads something outside
    trio: a supervisor's state, a process, a file); fails naming ``what`` after ``limit_s``."""
    with within(limit_s, what):
        while not condition():  # noqa: ASYNC110 (nothing to wait on: the condition is polled)
            await trio.sleep(poll_s)
