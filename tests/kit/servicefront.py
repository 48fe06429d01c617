"""A service front (``agent.service.front.ServiceFront``) served on a real socket from a thread of
the test process, with local jobs as its cells.

``FrontThread`` runs the front in a trio loop of its own thread (the test's clients are threads
with blocking httpx, as a user's are); ``call`` runs one of its synchronous methods in that loop
(``set_cells``, ``cut``, ``in_flight`` ...: the control plane's calls), so a test plays the cell
keeper by hand. ``cell_record`` is a local job as the keeper would put it in the table: its front
door and its decodes that are healthy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio
import trio.from_thread
import trio.lowlevel

from agent.job.frontpolicy import FrontPolicy
from agent.service.figures import ServiceFigures
from agent.service.front import ServiceFront
from agent.service.records import CellRecord, CellState
from agent.web.server import bound_socket
from tests.kit.jobs import LocalJob

START_S = 30.0
STOP_S = 30.0
T = TypeVar("T")


class FrontThread:
    """A ``ServiceFront`` serving on 127.0.0.1 (a port of its own) from a thread; a context
    manager that stops it."""

    def __init__(self, policy: FrontPolicy | None = None) -> None:
        self.figures = ServiceFigures()
        self.front = ServiceFront(policy or FrontPolicy(), self.figures)
        self._sock = bound_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="service-front", daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # said by __enter__ and __exit__
            self._failure = exc
            self._started.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                await nursery.start(self.front.run, self._sock)
                self._started.set()

    def call(self, method: Callable[..., T], *args: Any) -> T:
        """``method(*args)`` in the front's loop (a synchronous method of the front)."""
        assert self._token is not None, "the front is not running"
        return trio.from_thread.run_sync(method, *args, trio_token=self._token)

    def __enter__(self) -> FrontThread:
        self._thread.start()
        if not self._started.wait(START_S) or self._failure is not None:
            raise AssertionError(f"the service front did not start: {self._failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._scope is not None and self._thread.is_alive():
            assert self._token is not None
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(STOP_S)
        assert not self._thread.is_alive(), "the service front did not stop"
        if self._failure is not None:
            raise AssertionError(f"the service front failed: {self._failure!r}")


def cell_record(
    name: str, job: LocalJob, state: CellState = "ready", decodes: int | None = None
) -> CellRecord:
    """Local job ``job`` as cell ``name`` of the table: its front door (status.json
    ``front_url``) and its healthy decodes (or ``decodes``)."""
    status = job.status()
    healthy = sum(1 for a in status["agents"] if a["role"] == "decode" and a["state"] == "healthy")
    return CellRecord(
        name=name,
        state=state,
        front_url=status["front_url"],
        decodes=healthy if decodes is None else decodes,
    )
