"""A slow-to-start thing (a running job, an agent) shared by the tests of one module.

Each test gets it through a function-scoped fixture, never from the test before it: ``borrow``
starts it on first use, or anew when the last one has ended (a test stopped or killed it, a
fixture cancelled its Slurm job) or when the test that had it failed (whatever state it left),
and brings it to the state every test starts from (``prepare``: ready, healthy). A test that ends
it on purpose gets it through ``consume``, after which the next test starts a new one. So any test
passes alone or in any order, and a module run in file order pays for one start.

The test outcome comes from ``tests/conftest.py``'s report hook (``failed``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")

# Where tests/conftest.py keeps each test's call-phase report.
CALL_REPORT = pytest.StashKey[pytest.TestReport]()


def failed(request: pytest.FixtureRequest) -> bool:
    """The test using this fixture failed (its call phase; read from a fixture's teardown)."""
    report = request.node.stash.get(CALL_REPORT, None)
    return report is not None and report.failed


class Shared(Generic[T]):
    """One ``T`` at a time, from ``start()`` (a context manager: its exit ends it)."""

    def __init__(
        self,
        start: Callable[[], AbstractContextManager[T]],
        *,
        prepare: Callable[[T], object],
        ended: Callable[[T], bool],
    ) -> None:
        self._start = start
        self._prepare = prepare
        self._ended = ended
        self._current: T | None = None
        self._stack = contextlib.ExitStack()

    def get(self) -> T:
        """The current one, started if there is none or it has ended, then prepared; one that
        cannot be prepared is discarded (so the next test starts afresh) and the error raised."""
        if self._current is not None and self._ended(self._current):
            self.discard()
        if self._current is None:
            with contextlib.ExitStack() as stack:
                self._current = stack.enter_context(self._start())
                self._stack = stack.pop_all()
        current = self._current
        try:
            self._prepare(current)
        except BaseException:
            self.discard()
            raise
        return current

    def discard(self) -> None:
        """End the current one now (its context manager's exit)."""
        self._current = None
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    def borrow(self, request: pytest.FixtureRequest) -> Iterator[T]:
        """For a fixture: ``yield from shared.borrow(request)``: the current one, prepared; it
        is discarded after a test that failed."""
        yield self.get()
        if failed(request):
            self.discard()

    def consume(self) -> Iterator[T]:
        """For a fixture of a test that ends it: ``yield from shared.consume()``; discarded
        after the test, whatever it did."""
        try:
            yield self.get()
        finally:
            self.discard()

    def __enter__(self) -> Shared[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
