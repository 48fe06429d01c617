"""Which cell gets the next request: a ``ready`` cell with a free decode, else one FIFO queue.

A TileRT decode serves one request at a time, so the service front sends a cell no more requests
than it has ready decodes (its ``CellRecord.decodes``) and counts its own requests in flight at
each cell. A request takes a slot of the front's one queue (``agent.front.admission.Admission``,
reused: bounded in length and in time, 429 past them) whose capacity is the sum of the routable
cells' decodes plus what is still in flight at cells that take no new request; it is let in the
moment a request anywhere ends or the table grows (an event per waiter, nothing polled), and goes
to the routable cell least loaded (in flight per decode; then the one that took fewest).

The table comes whole from the control plane (``set_cells``, on every change): a cell takes new
requests while its state is ``ready``, it has a ``front_url`` and ready decodes. A cell that left
that set takes no new request and its requests run on where they are. A cell ``cut`` (its job
failed) never takes one again: each of its requests is told at once (``Route.guarded``), so one
still trying moves to another cell and a stream under way ends marked.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import trio

from agent.front.admission import Admission, QueueWatcher, Slot
from agent.front.proxy import RouterNow
from agent.service.records import CellRecord


class CellWatcher(QueueWatcher, Protocol):
    """What the slots tell the figures (``agent.service.figures.ServiceFigures``)."""

    def cell_load(self, cell: str, in_flight: int, decodes: int) -> None:
        """Cell ``cell`` has ``in_flight`` requests of ours and takes new ones on ``decodes``."""

    def cell_gone(self, cell: str) -> None:
        """Cell ``cell`` left the table with nothing in flight."""


class _Cell:
    """One cell as the data plane sees it."""

    def __init__(self, name: str, served: int) -> None:
        self.name = name
        self.url: str | None = None
        self.decodes = 0
        self.routable = False
        self.listed = False
        self.cut = False
        self.in_flight = 0
        self.taken = 0  # requests sent here in all (the tie-break that spreads them)
        self.served = served  # what the table said at first sight (a restarted front), + ours
        self.routes: set[Route] = set()

    def load(self) -> float:
        return self.in_flight / self.decodes if self.decodes else float("inf")


class Route:
    """One let-in request's place: its cell (None: no cell takes requests), and its slot of the
    front's queue; ``release`` gives both back (``agent.front.ticket.Held``)."""

    def __init__(self, slots: CellSlots, slot: Slot) -> None:
        self._slots = slots
        self._slot: Slot | None = slot
        self.cell: _Cell | None = None
        self._last: str | None = None  # the last cell it was at (it may have left every cell)
        self.was_cut = False  # its cell was cut while it was there (until it moves)
        self._scope: trio.CancelScope | None = None

    @property
    def cell_name(self) -> str | None:
        """The cell the request is at, or the last one it was at (its cells cut, say)."""
        return self.cell.name if self.cell is not None else self._last

    def now(self) -> RouterNow:
        """The request's cell as ``agent.front.proxy.Proxy`` asks at every try: its front door,
        or no URL when no cell takes it."""
        cell = self.cell
        if cell is None or cell.url is None or self.was_cut:
            return RouterNow(None, False, "no cell of the service takes requests now")
        return RouterNow(cell.url, True, f"cell {cell.name}")

    def move(self) -> None:
        """A try failed before the first byte, or its stream was cut (continued by
        ``agent.front.relay``): the request goes to another cell (a free one first); it stays
        where it is when no other takes requests, unless its cell was cut."""
        if self._slot is None:
            return
        current = self.cell
        cell = self._slots._pick(avoid=current)
        if cell is None and current is not None and not current.cut:
            return
        self._leave()
        self.was_cut = False
        self._at(cell)

    def cut_why(self) -> str:
        """Why its step at the cell was cancelled: the cell failed (the cut's mark)."""
        return f"its cell {self.cell_name} failed"

    def count_served(self) -> None:
        """The request ended served (its cell's ``served``)."""
        if self.cell is not None:
            self.cell.served += 1

    def release(self) -> None:
        """The request ended: its cell's count and its queue slot given back (idempotent,
        synchronous: safe in a ``finally`` under cancellation)."""
        slot, self._slot = self._slot, None
        if slot is None:
            return
        self._leave()
        slot.release()

    def cut(self) -> None:
        """Its cell failed: what it is doing there (``guarded``) is cancelled now."""
        self.was_cut = True
        if self._scope is not None:
            self._scope.cancel()

    @contextmanager
    def guarded(self) -> Iterator[trio.CancelScope]:
        """A step at the cell that a ``cut`` of it cancels (the scope's ``cancelled_caught``
        says so); cancelled at once if it was cut already."""
        scope = trio.CancelScope()
        if self.was_cut:
            scope.cancel()
        self._scope = scope
        try:
            with scope:
                yield scope
        finally:
            self._scope = None

    def _at(self, cell: _Cell | None) -> None:
        self.cell = cell
        if cell is not None:
            self._last = cell.name
            cell.in_flight += 1
            cell.taken += 1
            cell.routes.add(self)
            self._slots._changed(cell)

    def _leave(self) -> None:
        cell = self.cell
        if cell is not None and self in cell.routes:
            cell.routes.discard(self)
            cell.in_flight -= 1
            self._slots._changed(cell)


class CellSlots:
    """The cells' table as routing needs it, each cell's requests in flight, the one queue."""

    def __init__(
        self, *, max_waiting: int, max_wait_s: float, watcher: CellWatcher | None = None
    ) -> None:
        self.watcher = watcher
        self._cells: dict[str, _Cell] = {}  # every cell seen (names are never reused)
        self.admission = Admission(
            self.capacity, max_waiting=max_waiting, max_wait_s=max_wait_s, watcher=watcher
        )

    def set_cells(self, cells: Sequence[CellRecord]) -> None:
        """The whole table, on every change: who takes new requests from now on."""
        listed = {record.name for record in cells}
        for record in cells:
            cell = self._cells.get(record.name)
            if cell is None:
                cell = self._cells[record.name] = _Cell(record.name, record.served)
            cell.listed = True
            cell.url = record.front_url
            cell.decodes = record.decodes
            cell.routable = (
                record.state == "ready"
                and bool(record.front_url)
                and record.decodes > 0
                and not cell.cut
            )
            self._changed(cell)
        for cell in self._cells.values():
            if cell.name not in listed and cell.listed:
                cell.listed = cell.routable = False
                self._changed(cell)
        self.admission.changed()

    def cut(self, name: str) -> None:
        """Cell ``name`` failed: it takes no request again, and each of its requests is told
        now (a stream ends marked, a request before its first byte moves to another cell)."""
        cell = self._cells.get(name)
        if cell is None:
            cell = self._cells[name] = _Cell(name, 0)
        cell.cut = True
        cell.routable = False
        for route in list(cell.routes):
            route.cut()
        self._changed(cell)
        self.admission.changed()

    def capacity(self) -> int:
        """The queue's slots: each routable cell's decodes (or its requests in flight, if more),
        and the requests still in flight at cells that take no new one."""
        return sum(
            max(cell.decodes, cell.in_flight) if cell.routable else cell.in_flight
            for cell in self._cells.values()
        )

    def routable(self) -> list[str]:
        """The cells that take new requests now."""
        return [cell.name for cell in self._cells.values() if cell.routable]

    def urls(self) -> list[str]:
        """The front doors of the cells that take new requests now."""
        return [cell.url for cell in self._cells.values() if cell.routable and cell.url]

    def serving(self) -> bool:
        """Some cell takes requests."""
        return any(cell.routable for cell in self._cells.values())

    def in_flight(self, name: str) -> int:
        """Requests of this front at cell ``name`` now."""
        cell = self._cells.get(name)
        return cell.in_flight if cell is not None else 0

    def served(self, name: str) -> int:
        """Requests cell ``name`` served (what the table said at first sight, plus ours)."""
        cell = self._cells.get(name)
        return cell.served if cell is not None else 0

    async def enter(self) -> Route:
        """A slot once a decode is free somewhere (in the queue meanwhile), and the cell that
        takes the request (``QueueRefused`` past the queue's bounds)."""
        slot = await self.admission.enter()
        route = Route(self, slot)
        route._at(self._pick(avoid=None))
        return route

    def _pick(self, avoid: _Cell | None) -> _Cell | None:
        """The routable cell least loaded (in flight per decode: one with a free decode first;
        none free only when the table shrank meanwhile, and the cell's own front door queues
        it), then the one that took fewest."""
        ready = [c for c in self._cells.values() if c.routable and c is not avoid]
        return min(ready, key=lambda c: (c.load(), c.taken, c.name), default=None)

    def _changed(self, cell: _Cell) -> None:
        if self.watcher is None:
            return
        if not cell.listed and cell.in_flight == 0:
            self.watcher.cell_gone(cell.name)
        else:
            self.watcher.cell_load(cell.name, cell.in_flight, cell.decodes if cell.routable else 0)
