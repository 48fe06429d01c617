"""The cell keeper (agent/service/keeper.py) on trio's autojump clock, with a launcher whose cells
are job directories this test writes (as a cell's head would) and a front that records what it is
told: a succession with a ready cell at every moment, a failed cell cut and replaced after the
backoff, a restarted keeper adopting its cells and submitting nothing, stop ending every cell."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import trio

from agent.job.paths import JobDir
from agent.job.records import JobAgent, JobStatus
from agent.recipe.serviceplan import ServicePlan
from agent.service.keeper import CellKeeper, read_service
from agent.service.launcher import CellFacts, CellIds
from agent.service.paths import ServiceDir
from agent.service.records import CellRecord
from tests.kit.service import service_plan as kit_plan
from tests.kit.waiting import until as kit_until

LIMIT_S = 300.0


def service_plan(**over: object) -> ServicePlan:
    """The keeper's tests' plan: a 20 s drain, a LIMIT_S time limit."""
    return kit_plan(**{"drain_s": 20.0, "time_limit_s": LIMIT_S, **over})


class World:
    """The cells' jobs: which run, since when (trio's clock)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.dead: set[str] = set()


class Cells:
    """A CellLauncher over ``World``: submit writes a pending job, stop ends it."""

    backend: Literal["local", "slurm"] = "local"
    early_signal_s = 0.0

    def __init__(self, world: World) -> None:
        self.world = world
        self.submitted: list[str] = []
        self.stopped: list[str] = []

    async def submit(self, job: JobDir) -> CellIds:
        job.create()
        job.write_status(JobStatus(state="pending", model="m"))
        name = job.root.name
        self.submitted.append(name)
        self.world.started[name] = trio.current_time()
        return CellIds(local_pid=1000 + len(self.world.started), local_started_at=0.0)

    async def facts(self, cell: CellRecord, job: JobDir) -> CellFacts:
        del job
        if cell.name in self.world.dead:
            return CellFacts(running=False)
        left = self.world.started[cell.name] + LIMIT_S - trio.current_time()
        return CellFacts(running=True, time_left_s=max(left, 0.0))

    async def stop(self, cell: CellRecord, job: JobDir, limit: float) -> None:
        del limit
        self.stopped.append(cell.name)
        self.world.dead.add(cell.name)
        job.write_status(JobStatus(state="stopped", model="m"))


class Front:
    """The data plane as the keeper sees it: the tables it got, the cuts, the carried counts."""

    def __init__(self) -> None:
        self.tables: list[list[tuple[str, str]]] = []
        self.cuts: list[str] = []
        self.flight: dict[str, int] = {}
        self.carried: dict[str, int] = {}

    def set_cells(self, cells: Sequence[CellRecord]) -> None:
        self.tables.append([(c.name, c.state) for c in cells])

    def cut(self, name: str) -> None:
        self.cuts.append(name)

    def in_flight(self, name: str) -> int:
        return self.flight.get(name, 0)

    def served(self, name: str) -> int:
        del name
        return 0

    def requests(self) -> dict[str, int]:
        return {"ok": 3, **self.carried}

    def carry(self, requests: Mapping[str, int]) -> None:
        self.carried = dict(requests)

    def serving(self) -> bool:
        return any(state == "ready" for state in dict(self.tables[-1]).values())


class Figures:
    def __init__(self) -> None:
        self.successions = 0
        self.replacements = 0

    def cells(self, states: Mapping[str, int]) -> None:
        del states

    def succession(self) -> None:
        self.successions += 1

    def replacement(self) -> None:
        self.replacements += 1


def serve(sdir: ServiceDir, name: str) -> None:
    """Cell ``name``'s head says ready: a front door and one healthy decode."""
    decode = JobAgent(
        name="decode-0", role="decode", index=0, node="n", state="healthy", restarts=0,
        reason="", log="", metrics_url=None, status_url=None,
    )  # fmt: skip
    url = f"http://127.0.0.1:9{name[-1]}00"
    sdir.cell(name).write_status(
        JobStatus(state="ready", model="m", front_url=url, agents=[decode])
    )


def keeper(sdir: ServiceDir, launcher: Cells, front: Front, **over: object) -> CellKeeper:
    return CellKeeper(
        sdir, service_plan(**over), launcher, front, Figures(), name="svc",
        front_url="http://127.0.0.1:8090", poll_s=2.0, now=trio.current_time,
    )  # fmt: skip


async def until(predicate: Callable[[], object], what: str = "the keeper") -> None:
    """Wait on trio's (autojumping) clock until ``predicate()`` holds."""
    await kit_until(predicate, what, limit_s=600.0, poll_s=0.5)


def states(k: CellKeeper) -> dict[str, str]:
    return {c.name: c.state for c in k.cells}


async def test_a_succession_keeps_a_ready_cell_at_every_moment(
    tmp_path: object,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    sdir = ServiceDir(tmp_path)  # type: ignore[arg-type]
    sdir.cells.mkdir()
    world, front = World(), Front()
    cells = Cells(world)
    k = keeper(sdir, cells, front)
    async with trio.open_nursery() as nursery:
        await nursery.start(k.run)
        await until(lambda: cells.submitted == ["cell-1"])
        serve(sdir, "cell-1")
        await until(lambda: states(k) == {"cell-1": "ready"})
        first_ready = trio.current_time()
        # Nothing more until the lead before the end.
        await until(lambda: len(cells.submitted) == 2)
        assert trio.current_time() - world.started["cell-1"] >= LIMIT_S - 60.0 - 2.5
        assert cells.submitted[1] == "cell-2"
        assert k.cells[1].follows == "cell-1"
        front.flight["cell-1"] = 2  # streams still running at the old cell
        serve(sdir, "cell-2")
        await until(lambda: states(k) == {"cell-1": "retiring", "cell-2": "ready"})
        assert k.successions == 1
        front.flight["cell-1"] = 0
        await until(lambda: states(k)["cell-1"] == "ended")
        assert cells.stopped == ["cell-1"]
        nursery.cancel_scope.cancel()
    # Once a cell was ready, every table the front got had a ready cell in it.
    after = [t for t in front.tables if ("cell-1", "ready") in t or ("cell-2", "ready") in t]
    assert after
    assert front.tables.index(after[0]) + len(after) == len(front.tables)
    assert first_ready > 0
    saved = read_service(sdir)
    assert saved is not None
    assert saved.successions == 1
    assert [c.state for c in saved.cells] == ["ended", "ready"]


async def test_a_failed_cell_is_cut_and_replaced_after_the_backoff(
    tmp_path: object,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    sdir = ServiceDir(tmp_path)  # type: ignore[arg-type]
    sdir.cells.mkdir()
    world, front = World(), Front()
    cells = Cells(world)
    k = keeper(sdir, cells, front, replace_max_per_hour=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(k.run)
        await until(lambda: cells.submitted == ["cell-1"])
        serve(sdir, "cell-1")
        await until(lambda: states(k) == {"cell-1": "ready"})
        world.dead.add("cell-1")
        failed_at = trio.current_time()
        await until(lambda: states(k)["cell-1"] == "failed")
        assert front.cuts == ["cell-1"]
        await until(lambda: len(cells.submitted) == 2)
        assert trio.current_time() - failed_at >= 10.0  # replace.backoff_s
        assert k.cells[1].reason == "replacement"
        assert k.cells[1].follows == "cell-1"
        serve(sdir, "cell-2")
        await until(lambda: states(k)["cell-2"] == "ready")
        # A second failure in the hour: past the bound, not replaced, and said.
        world.dead.add("cell-2")
        await until(lambda: k.held is not None and "max_per_hour" in k.held)
        await trio.sleep(120)
        assert cells.submitted == ["cell-1", "cell-2"]
        nursery.cancel_scope.cancel()
    saved = read_service(sdir)
    assert saved is not None
    assert saved.replacements == 1
    assert saved.state == "starting"
    assert saved.error is not None
    assert "max_per_hour" in saved.error


async def test_a_restarted_keeper_adopts_its_cells_and_submits_nothing(
    tmp_path: object,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    sdir = ServiceDir(tmp_path)  # type: ignore[arg-type]
    sdir.cells.mkdir()
    world = World()
    first = Cells(world)
    k1 = keeper(sdir, first, Front(), cells=2, max_cells=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(k1.run)
        await until(lambda: sorted(first.submitted) == ["cell-1", "cell-2"])
        serve(sdir, "cell-1")
        serve(sdir, "cell-2")
        await until(lambda: states(k1) == {"cell-1": "ready", "cell-2": "ready"})
        nursery.cancel_scope.cancel()  # as SIGKILL: nothing stopped
    world.dead.add("cell-2")  # ended while no front ran
    again, front = Cells(world), Front()
    k2 = keeper(sdir, again, front, cells=2, max_cells=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(k2.run)
        assert k2.adopted == ["cell-1"]
        assert states(k2)["cell-1"] == "ready"
        assert states(k2)["cell-2"] == "failed"
        assert front.carried == {"ok": 3}
        assert ("cell-1", "ready") in front.tables[0]
        # Only cell-2's replacement is submitted (after its backoff), never cell-1 again.
        await until(lambda: len(again.submitted) == 1)
        assert again.submitted == ["cell-3"]
        assert k2.cells[2].follows == "cell-2"
        nursery.cancel_scope.cancel()


async def test_stop_ends_every_live_cell(
    tmp_path: object,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
) -> None:
    sdir = ServiceDir(tmp_path)  # type: ignore[arg-type]
    sdir.cells.mkdir()
    world, front = World(), Front()
    cells = Cells(world)
    k = keeper(sdir, cells, front, cells=2, max_cells=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(k.run)
        await until(lambda: len(cells.submitted) == 2)
        serve(sdir, "cell-1")
        await until(lambda: states(k)["cell-1"] == "ready")
        await k.stop()
        nursery.cancel_scope.cancel()
    assert sorted(cells.stopped) == ["cell-1", "cell-2"]
    saved = read_service(sdir)
    assert saved is not None
    assert saved.state == "stopped"
    assert {c.state for c in saved.cells} == {"ended"}
