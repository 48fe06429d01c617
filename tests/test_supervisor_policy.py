"""``EngineSupervisor``'s decisions on scripted engines: restart, backoff, give up, stop.

No process is started: ``tests.kit.fakelauncher`` plays the engines (their exits, their lines,
their ``/health`` answers through an ``httpx.MockTransport``) on trio's autojump clock, so the
backoffs pass without real time. What only a real process shows (signals, process groups, a
foreign process on our port) is in tests/test_supervisor.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from agent.launch import LaunchSpec
from agent.node.policy import Policy
from agent.node.supervisor import EngineSupervisor, Patience
from tests import kit
from tests.kit.fakelauncher import Engine, FakeLauncher, InlineSink

# Every test takes ``autojump_clock`` (pytest-trio runs a test on the clock it requests; through
# ``usefixtures`` it would not): backoffs and probe intervals then pass without real time.


POLICY = Policy(
    probe_startup_interval_s=0.05,
    probe_interval_s=1.0,
    probe_timeout_s=1.0,
    probe_failure_threshold=3,
    restart_backoff_initial_s=1.0,
    restart_backoff_max_s=4.0,
    restart_max=4,
    restart_window_s=600.0,
    startup_budget_s=600.0,
    stop_grace_s=5.0,
)
CRASH = Engine(lines=("RuntimeError: weights are corrupt",), healthy_after=None, exit_after=2.0)


class Harness:
    """A supervisor over a ``FakeLauncher``; records the states it went through and its restarts."""

    def __init__(
        self,
        tmp: Path,
        script: Sequence[Engine],
        policy: Policy = POLICY,
        patience: Patience | None = None,
    ) -> None:
        self.launcher = FakeLauncher(script)
        self.client = httpx.AsyncClient(transport=self.launcher.health_transport())
        self.states: list[str] = []
        self.log = logging.getLogger(f"test-supervisor-policy-{id(self)}")
        self.sink = InlineSink(tmp / "engine.log", max_bytes=1 << 20, backups=0)
        self.sup = EngineSupervisor(
            name="engine",
            launcher=self.launcher,
            build=lambda: LaunchSpec(name="engine", argv=["engine", "--serve"], env={}),
            health_url=lambda: "http://127.0.0.1:8100/health",
            ports=lambda: {"http": 8100},
            policy=policy,
            sink=self.sink,
            log=self.log,
            on_change=lambda: self.states.append(self.sup.state),
            client=self.client,
            patience=patience,
        )

    def restart_delays(self, caplog: pytest.LogCaptureFixture) -> list[str]:
        """The delay of each crash restart, as the supervisor logged it."""
        return [
            r.getMessage().rsplit(" in ", 1)[1]
            for r in caplog.records
            if r.name == self.log.name and "; restart " in r.getMessage()
        ]


@asynccontextmanager
async def running(h: Harness) -> AsyncIterator[trio.Nursery]:
    """The supervisor running in a nursery; stopped (and its client closed) after."""
    async with h.client, trio.open_nursery() as nursery:
        nursery.start_soon(h.sup.run)
        yield nursery
        with trio.fail_after(60):
            await h.sup.stop()


async def test_a_crashing_engine_is_restarted_with_doubling_backoff_then_given_up(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(tmp_path, [CRASH])
    with caplog.at_level(logging.WARNING, logger=h.log.name), trio.fail_after(120):
        await h.sup.run()
    assert h.restart_delays(caplog) == ["1.0s", "2.0s", "4.0s", "4.0s"]
    assert len(h.launcher.started) == 5  # the first start and max_restarts restarts
    assert h.sup.state == "failed"
    assert "gave up after 4 restarts within 600s" in h.sup.reason
    assert "agent.restart.max_restarts" in h.sup.reason
    assert "exited with code 1 before becoming healthy" in h.sup.reason
    # Given up: the last lines of the engine go to the agent's log, with why.
    failure = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert "RuntimeError: weights are corrupt" in failure.getMessage()
    assert h.states.count("restarting") == 4


async def test_restarts_outside_the_window_do_not_count(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each engine serves, then dies; a short window forgets each crash before the next one, so
    # the supervisor never gives up and every restart is the immediate "first in the window".
    serves_then_dies = Engine(healthy_after=0.0, exit_after=30.0, code=3)
    h = Harness(tmp_path, [serves_then_dies], Policy(**{**vars(POLICY), "restart_window_s": 0.0}))
    with caplog.at_level(logging.WARNING, logger=h.log.name):
        async with running(h):
            await kit.until(lambda: len(h.launcher.started) >= 7, "seven generations", 600, 1.0)
    assert h.sup.state == "stopped"
    assert set(h.restart_delays(caplog)) == {"0.0s"}


async def test_an_engine_that_served_is_restarted_at_once_then_backs_off(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    serves_then_dies = Engine(healthy_after=0.0, exit_after=5.0, code=3)
    h = Harness(tmp_path, [serves_then_dies, CRASH, CRASH, Engine()])
    with caplog.at_level(logging.WARNING, logger=h.log.name):
        async with running(h):
            await kit.until(lambda: len(h.launcher.started) == 4, "the fourth generation", 60)
            await kit.until(lambda: h.sup.state == "healthy", "the engine healthy again")
            assert h.sup.restarts == 3
    assert h.restart_delays(caplog) == ["0.0s", "2.0s", "4.0s"]
    assert h.sup.stats.healthy_count == 2


async def test_probe_failures_make_it_unhealthy_then_it_is_restarted(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
) -> None:
    # The first engine answers, then stops answering while it keeps running (a hung engine).
    h = Harness(tmp_path, [Engine(healthy_after=0.0), Engine()])
    async with running(h):
        await kit.until(lambda: h.sup.state == "healthy", "the engine healthy")
        first = h.launcher.started[0]
        first.engine = Engine(healthy_after=None)  # hangs: no more answers
        await kit.until(lambda: len(h.launcher.started) == 2, "a second generation")
        await kit.until(lambda: h.sup.state == "healthy", "the second engine healthy")
        assert first.returncode is not None  # the hung engine was stopped before the restart
        assert "unhealthy" in h.states
    assert "3 consecutive health probe failures" in h.sink.path.read_text()


class Busy:
    """A ``Patience`` that excuses failed probes while ``busy`` (the head's starved router)."""

    def __init__(self) -> None:
        self.busy = True
        self.excused = 0
        self.answers = 0

    def answered(self) -> None:
        self.answers += 1

    async def excuse(self, client: httpx.AsyncClient) -> bool:  # noqa: ARG002
        self.excused += self.busy
        return self.busy


async def test_excused_probe_failures_do_not_restart_until_no_longer_excused(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
) -> None:
    """An engine whose probes fail while its patience excuses them stays healthy (no restart,
    however long); once they are no longer excused, the threshold counts as before."""
    patience = Busy()
    h = Harness(tmp_path, [Engine(healthy_after=0.0), Engine()], patience=patience)
    async with running(h):
        await kit.until(lambda: patience.answers >= 1, "a liveness probe answered", 60, 1.0)
        h.launcher.started[0].engine = Engine(healthy_after=None)  # /health stops answering
        await kit.until(lambda: patience.excused >= 50, "fifty excused failures", 600, 1.0)
        assert h.sup.state == "healthy"
        assert len(h.launcher.started) == 1
        patience.busy = False
        await kit.until(lambda: len(h.launcher.started) == 2, "the restart once not excused")
    assert "unhealthy" in h.states


async def test_a_stop_during_the_backoff_ends_stopped_without_another_start(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, [CRASH], Policy(**{**vars(POLICY), "restart_backoff_initial_s": 300.0}))
    async with running(h):
        await kit.until(lambda: h.sup.state == "restarting", "the engine restarting")
    assert h.sup.state == "stopped"
    assert len(h.launcher.started) == 1


async def test_a_stubborn_engine_is_killed_after_the_grace(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, [Engine(ignores_sigterm=True)])
    async with running(h):
        await kit.until(lambda: h.sup.state == "healthy", "the engine healthy")
        t0 = trio.current_time()
    assert trio.current_time() - t0 == pytest.approx(POLICY.stop_grace_s, abs=0.5)
    engine = h.launcher.started[0]
    assert [s.name for s in engine.signals] == ["SIGTERM", "SIGKILL"]
    assert h.states[-2:] == ["stopping", "stopped"]


async def test_the_startup_budget_runs_on_trio_s_clock(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
) -> None:
    # An engine that never answers: the budget ends it at 30 s of trio time (a deadline taken
    # from time.monotonic() never came on this clock, and the test hit its fail_after).
    policy = Policy(**{**vars(POLICY), "startup_budget_s": 30.0})
    h = Harness(tmp_path, [Engine(healthy_after=None)], policy)
    t0 = trio.current_time()
    with trio.fail_after(120):
        await h.sup.run()
    assert h.sup.state == "failed"
    assert "not healthy within the startup budget of 30s" in h.sup.reason
    assert trio.current_time() - t0 == pytest.approx(30.0, abs=1.0)


async def test_the_restart_window_runs_on_trio_s_clock(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Crashes 30 s apart with a 10 s window: each is the first in its window, so every restart
    # waits the initial backoff and it never gives up (crash times taken from time.monotonic()
    # all fell within the window and it gave up after four).
    crash_late = Engine(healthy_after=None, exit_after=30.0)
    h = Harness(tmp_path, [crash_late], Policy(**{**vars(POLICY), "restart_window_s": 10.0}))
    with caplog.at_level(logging.WARNING, logger=h.log.name):
        async with running(h):
            await kit.until(lambda: len(h.launcher.started) >= 7, "seven generations", 600, 1.0)
    assert h.sup.state == "stopped"
    assert set(h.restart_delays(caplog)) == {"1.0s"}
