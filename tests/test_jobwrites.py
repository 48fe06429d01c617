"""Writes into the job directory that fail (full, read-only, removed) never stop the agent: each is
retried with backoff, shown in ``problems`` and logged once per change. Real faults on a mounted
tmpfs are in tests/test_serving_faults.py; here the failures are made to order."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

import pytest
import trio

from agent.node.jobwrites import RETRY_INITIAL_S, RETRY_MAX_S, JobWrites

LOG = logging.getLogger("test_jobwrites")


class Disk:
    """A file whose writes fail with ``error`` while it is set."""

    def __init__(self) -> None:
        self.error: int | None = None
        self.content: str | None = None
        self.attempts = 0

    def writer(self, content: str) -> Callable[[], None]:
        """A write of ``content``."""

        def write() -> None:
            self.attempts += 1
            if self.error is not None:
                raise OSError(self.error, os.strerror(self.error), "/j/.status.tmp")
            self.content = content

        return write


def test_a_failed_write_is_a_problem_logged_once_then_cleared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOG.name)
    changes: list[int] = []
    writes = JobWrites(LOG, on_change=lambda: changes.append(1))
    disk = Disk()
    disk.error = errno.ENOSPC
    assert writes.write("/j/status.json", disk.writer("a")) is False
    assert writes.write("/j/status.json", disk.writer("b")) is False
    assert writes.problems() == ["cannot write /j/status.json: No space left on device"]
    disk.error = errno.EROFS
    assert writes.write("/j/status.json", disk.writer("c")) is False
    assert writes.problems() == ["cannot write /j/status.json: Read-only file system"]
    disk.error = None
    assert writes.write("/j/status.json", disk.writer("d")) is True
    assert writes.problems() == []
    assert disk.content == "d"
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        (
            "WARNING",
            "cannot write /j/status.json: No space left on device; the engines keep serving; "
            f"retrying every {RETRY_MAX_S:g} s at most",
        ),
        (
            "WARNING",
            "cannot write /j/status.json: Read-only file system; the engines keep serving; "
            f"retrying every {RETRY_MAX_S:g} s at most",
        ),
        ("INFO", "/j/status.json written again"),
    ]
    assert len(changes) == 3  # each change of what /status shows


async def test_failed_writes_are_retried_with_backoff_until_they_succeed(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    writes = JobWrites(LOG, on_change=lambda: None)
    disk = Disk()
    disk.error = errno.ENOSPC
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes.retry)
        start = trio.current_time()
        writes.write("/j/rendezvous/decode-0.json", disk.writer("old"))
        writes.write("/j/rendezvous/decode-0.json", disk.writer("new"))  # replaces the old one
        await trio.sleep(RETRY_INITIAL_S * (1 + 2 + 4 + 8) + 0.01)
        assert disk.attempts == 2 + 4  # two now, then one per backoff step
        disk.error = None
        await trio.sleep(RETRY_MAX_S + 0.01)
        assert disk.content == "new"
        assert writes.problems() == []
        attempts = disk.attempts
        await trio.sleep(100)
        assert disk.attempts == attempts  # nothing pending: nothing retried
        assert trio.current_time() - start > 100
        nursery.cancel_scope.cancel()
