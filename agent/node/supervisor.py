"""One engine's life: start, prove ready, watch, restart with backoff, give up, stop.

States are the ``/status`` vocabulary of docs/agent.md::

    starting --(startup probe ok)--> healthy --(N probe failures)--> unhealthy --+
       |  ^                            |                                        |
       |  +------ restarting <---------+--(engine exited)-----------------------+
       |              ^
       |              +--(relaunch: a restart asked for, or a hand-over, below)-- any running state
       +--(budget exceeded / too many restarts in the window)--> failed
    any --(stop requested)--> stopping --> stopped

    a hand-over (relaunch(handover=True), agent.node.handover; the head's router):
      old engine: SIGTERM --> draining beside the new one --(its streams end, or SIGKILL after
                  the drain time)--> ended
      new engine: restarting --(the old one's ports free)--> starting --(probe ok)--> healthy
                  --(the head's canaries pass)--> proven; clients wait for it at the front door

An engine exit is a failure unless we are stopping (vLLM's API process exits 0 when its engine
dies). An engine that exits with "address in use" before it was ever healthy gets new ports from
``on_address_in_use`` (no backoff, not a crash); once healthy, ports are sticky. An engine that
served and then died is restarted at once the first time (users wait for it); the backoff is for
one that dies again within the window, or never serves.

The engine's log tells the same story in place, one marker line each (docs/logs.md): ``=== NAME
generation N started, pid P: ARGV ===`` at every start, ``=== NAME restart N: WHY; ... ===`` when
it is restarted, ``=== NAME failed: WHY ===`` when it is given up, ``=== NAME stopped ... ===``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import trio

from agent.job.records import EngineStatus
from agent.job.vocab import EngineState
from agent.launch import Launcher, LaunchSpec, ProcessHandle
from agent.node.enginefate import (
    address_in_use,
    answered_by_engine,
    ended,
    exit_reason,
    generation_note,
    startup_over,
)
from agent.node.enginewatch import EngineWatch
from agent.node.handover import HandOver
from agent.node.logpump import LogSink
from agent.node.policy import Policy
from agent.problems import printable
from agent.signatures import Where

FAILURE_LOG_LINES = 50
# How long an engine that exited while starting may take to get its last lines to the log pump.
_LAST_LINES_S = 2.0


class Patience(Protocol):
    """Whether a failed liveness probe is excused: the engine is alive but busy, not dead."""

    def answered(self) -> None:
        """The probe passed."""

    async def excuse(self, client: httpx.AsyncClient) -> bool:
        """After a failed probe: True when it does not count as a failure."""


@dataclass
class Stats:
    """What metrics read: counters and the last observations."""

    probe_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    time_to_healthy_s: float | None = None
    healthy_count: int = 0


class EngineSupervisor:
    """Supervises one engine; ``run`` until failed or stopped, ``stop`` from another task."""

    def __init__(
        self,
        *,
        name: str,
        launcher: Launcher,
        build: Callable[[], LaunchSpec],
        health_url: Callable[[], str],
        ports: Callable[[], dict[str, int]],
        policy: Policy,
        sink: LogSink,
        log: logging.Logger,
        on_change: Callable[[], None],
        on_address_in_use: Callable[[], None] | None = None,
        observe_probe: Callable[[float], None] | None = None,
        client: httpx.AsyncClient | None = None,
        handover_drain_s: float = 0.0,
        where: Where | None = None,
        patience: Patience | None = None,
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.build = build
        self.health_url = health_url
        self.ports = ports
        self.policy = policy
        self.sink = sink
        self.log = log
        self.on_change = on_change
        self.on_address_in_use = on_address_in_use
        self.observe_probe = observe_probe
        # Excuses a failed probe of an engine alive but too busy to answer (the head's router).
        self.patience = patience
        # The agent's shared client (agent.http.client); None: one of its own (tests).
        self.client = client
        self.state: EngineState = "starting"
        self.reason = "not started yet"
        self.since = time.time()
        self.restarts = 0
        self.process: ProcessHandle | None = None
        self.generation = 0
        self.started_at: float | None = None
        # Wall clock of the moment the engine was found healthy (the head's gate starts there).
        self.healthy_at: float | None = None
        self.ever_healthy = False
        self.stats = Stats()
        self.stopping = False
        self._restart_times: deque[float] = deque()
        self._relaunch_reason: str | None = None
        # A hand-over relaunch (``relaunch(handover=True)``, agent.node.handover): the old engine
        # drains in the background while the new one starts as soon as its ports are free.
        self.handover = HandOver(
            name=name,
            sink=sink,
            log=log,
            ports=ports,
            drain_s=handover_drain_s,
            grace_s=policy.stop_grace_s,
        )
        self._cancel = trio.CancelScope()
        self._probe_wakeup = trio.Event()
        self.done = trio.Event()
        # What the engine's log says (progress while starting, failure signatures); ``where``
        # names whose signatures apply: prefill, decode or router.
        self.watch: EngineWatch | None = None
        if where is not None:
            self.watch = EngineWatch(where, on_fatal=self._wake)
            sink.watchers.append(self.watch.feed)
            sink.partial_watchers.append(self.watch.feed_partial)

    # ---- what others read ------------------------------------------------------------------

    def status(self) -> EngineStatus:
        """The ``/status`` view of this engine."""
        alive = self.process is not None and self.process.returncode is None
        watch = self.watch
        starting = watch is not None and watch.starting and self.state == "starting"
        return EngineStatus(
            state=self.state,
            pid=self.process.pid if alive and self.process else None,
            ports=self.ports(),
            restarts=self.restarts,
            reason=self.explained_reason(),
            since=self.since,
            uptime_s=(time.time() - self.started_at) if alive and self.started_at else None,
            healthy_at=self.healthy_at if self.state == "healthy" else None,
            progress=watch.progress if starting and watch else None,
            progress_at=watch.progress_at if starting and watch else None,
        )

    def explained_reason(self) -> str:
        """``reason`` with the cause and fix of the failure signature the log showed, if any."""
        if self.watch is None or self.state in ("stopping", "stopped"):
            return self.reason
        healthy = self.state == "healthy"
        found = self.watch.diagnosis(recent_only=healthy)
        if found is None:
            return self.reason
        if healthy:
            return f"{self.reason}; but its log shows: {found.reason()}"
        return f"{found.reason()} ({self.reason})"

    def _wake(self) -> None:
        """Wake the probe loop now (a fatal line in the log)."""
        self._probe_wakeup.set()

    def _mark(self, text: str) -> None:
        """One marker line in the engine's log, where ``tilert-submit logs -f`` shows it."""
        self.sink.note(f"=== {self.name} {text} ===")

    def _set(self, state: EngineState, reason: str) -> None:
        if state == self.state and reason == self.reason:
            return
        previous = self.state
        self.state, self.reason, self.since = state, reason, time.time()
        level = logging.WARNING if state in ("unhealthy", "restarting", "failed") else logging.INFO
        if previous == state:
            self.log.log(level, "%s: %s: %s", self.name, state, reason)
        else:
            self.log.log(level, "%s: %s -> %s: %s", self.name, previous, state, reason)
        self.on_change()

    # ---- control ---------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop for good: the engine gets SIGTERM, the grace, then SIGKILL. Returns when done."""
        self.stopping = True
        self._cancel.cancel()
        self.handover.cut()  # a handed-over engine still draining: the stop grace from now
        await self.done.wait()

    def relaunch(self, reason: str, *, handover: bool = False) -> None:
        """Stop the engine and start it again with a fresh ``build()`` (not counted as a crash).

        It counts in ``restarts`` (what operators see), not against the restart limit, and the
        state says so at once, so nobody reads the old engine as healthy meanwhile. With
        ``handover`` the old engine gets SIGTERM and finishes what it serves in the background
        (within its grace), and the new one starts the moment its ports are free: for the router,
        whose SIGTERM closes its listener at once and then waits for its in-flight streams.
        """
        self._relaunch_reason = reason
        self.handover.asked = handover
        self.restarts += 1
        self._set("restarting", reason)
        self._probe_wakeup.set()

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Supervise until failed or stopped (and until every handed-over engine has ended)."""
        try:
            async with self.handover.open():
                try:
                    with self._cancel:
                        await self._loop()
                finally:
                    with trio.CancelScope(shield=True):
                        if self.process is not None:
                            await self._stop_engine(self.process)
                        if self.stopping and self.state != "failed":
                            self._set("stopped", "stopped on request")
                            self._mark(_stopped_note(self.process))
        finally:
            self.done.set()

    async def _stop_engine(self, engine: ProcessHandle) -> None:
        if engine.returncode is not None:
            return
        if self.stopping and self.state != "failed":
            self._set("stopping", f"stop requested; grace {self.policy.stop_grace_s:g}s")
        code = await engine.stop(self.policy.stop_grace_s)
        self.log.info("%s: engine pid %s ended with status %d", self.name, engine.pid, code)

    async def _loop(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            client = self.client
            if client is None:
                client = await stack.enter_async_context(httpx.AsyncClient())
            while True:
                served_before = self.stats.healthy_count
                outcome = await self._one_generation(client)
                if outcome is None:
                    return  # failed for good (state already set)
                if self._relaunch_reason is not None:
                    reason, self._relaunch_reason = self._relaunch_reason, None
                    self._set("restarting", reason)
                    self._mark(f"restart {self.restarts}: {reason}")
                    continue
                now = trio.current_time()
                self._restart_times.append(now)
                while (
                    self._restart_times
                    and now - self._restart_times[0] > self.policy.restart_window_s
                ):
                    self._restart_times.popleft()
                if len(self._restart_times) > self.policy.restart_max:
                    self._fail(
                        f"{outcome}; gave up after {self.policy.restart_max} restarts within "
                        f"{self.policy.restart_window_s:g}s (agent.restart.max_restarts / window_s)"
                    )
                    return
                delay = min(
                    self.policy.restart_backoff_max_s,
                    self.policy.restart_backoff_initial_s * 2 ** (len(self._restart_times) - 1),
                )
                if len(self._restart_times) == 1 and self.stats.healthy_count > served_before:
                    # It served, then died: the first restart in the window is at once (users
                    # wait for it); backoff is for an engine that dies again or never serves.
                    delay = 0.0
                self.restarts += 1
                self._set("restarting", f"{outcome}; restart {self.restarts} in {delay:.1f}s")
                self._mark(f"restart {self.restarts}: {outcome}; starting again in {delay:.1f}s")
                await trio.sleep(delay)

    def _fail(self, reason: str) -> None:
        self._set("failed", reason)
        reason = self.explained_reason()
        self._mark(f"failed: {reason}")
        lines = self.sink.recent(FAILURE_LOG_LINES)
        self.log.error(
            "%s failed: %s\n--- last %d lines of %s ---\n%s\n--- end ---",
            self.name,
            reason,
            len(lines),
            self.sink.path,
            "\n".join(printable(line) for line in lines),  # the engine's words, escaped
        )

    async def _one_generation(self, client: httpx.AsyncClient) -> str | None:
        """Run the engine once; return why it ended (restartable), or None when failed for good."""
        await self.handover.ports_free()  # after a hand-over: the old engine's ports
        spec = self.build()
        self.generation += 1
        self._probe_wakeup = trio.Event()
        if self.watch is not None:
            self.watch.new_generation()
        if self.state != "restarting":
            self._set("starting", f"launching (generation {self.generation})")
        start = trio.current_time()  # the startup deadline's origin: trio's clock, as its waits
        try:
            engine = await self.launcher.start(spec)
        except OSError as exc:
            self._fail(f"could not start {spec.argv[0]}: {exc}")
            return None
        self.process = engine
        self.started_at = time.time()
        note = generation_note(self.name, self.generation)
        self.sink.note(f"{note}, pid {engine.pid}: {' '.join(spec.argv)} ===")
        self._set("starting", f"engine pid {engine.pid} started; waiting for {self.health_url()}")
        async with trio.open_nursery() as nursery:
            pumped = trio.Event()

            async def pump() -> None:
                try:
                    await self.sink.pump(engine.output)
                finally:
                    pumped.set()  # also when cancelled by a stop: nobody should wait for it then

            nursery.start_soon(pump)
            exited = trio.Event()

            async def wait_exit() -> None:
                await engine.wait()
                exited.set()
                self._probe_wakeup.set()

            nursery.start_soon(wait_exit)
            try:
                result = await self._watch(client, engine, exited, start, pumped)
            finally:
                with trio.CancelScope(shield=True):
                    if not self.handover.take(engine, pumped, stopping=self.stopping):
                        await self._stop_engine(engine)
                        # The pipe reaches EOF once the engine's group is gone; a stray holder of
                        # it must not keep this generation alive.
                        with trio.move_on_after(2.0):
                            await pumped.wait()
                nursery.cancel_scope.cancel()
        return result

    async def _probe(self, client: httpx.AsyncClient) -> bool:
        t0 = trio.current_time()
        try:
            response = await client.get(self.health_url(), timeout=self.policy.probe_timeout_s)
            ok = response.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        latency = trio.current_time() - t0
        self.stats.probe_latencies.append(latency)
        if self.observe_probe is not None:
            self.observe_probe(latency)
        return ok

    async def _sleep_or_wake(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self._probe_wakeup.wait()

    async def _watch(
        self,
        client: httpx.AsyncClient,
        engine: ProcessHandle,
        exited: trio.Event,
        start: float,
        pumped: trio.Event,
    ) -> str | None:
        healthy, outcome = await self._until_healthy(client, engine, exited, start, pumped)
        if self.watch is not None:
            self.watch.starting = False
        if not healthy:
            return outcome
        elapsed = trio.current_time() - start
        self.healthy_at = time.time()
        self.ever_healthy = True
        self.stats.time_to_healthy_s = elapsed
        self.stats.healthy_count += 1
        self._set("healthy", f"{self.health_url()} answered 200 after {elapsed:.2f}s")
        return await self._while_healthy(client, engine, exited)

    async def _until_healthy(
        self,
        client: httpx.AsyncClient,
        engine: ProcessHandle,
        exited: trio.Event,
        start: float,
        pumped: trio.Event,
    ) -> tuple[bool, str | None]:
        """Startup probe: (True, None) once the engine answers, else (False, what ended it).

        It ends at once on a fatal line in the log, and at a deadline that progress lines move
        (``agent.node.enginefate.startup_over``).
        """
        policy = self.policy
        # Fast, so readiness is seen within ~50 ms.
        while True:
            if self._relaunch_reason is not None:
                return False, "relaunch"
            if exited.is_set():
                # Its last lines may still be in the pipe: a fatal one decides, not the exit.
                with trio.move_on_after(_LAST_LINES_S if self.watch is not None else 0):
                    await pumped.wait()
                if self.watch is not None and self.watch.fatal is not None:
                    self._fail(
                        startup_over(
                            self.policy, self.watch, start, trio.current_time(), self.health_url()
                        )
                        or "a fatal line in its log"
                    )
                    return False, None
                if (
                    not self.ever_healthy
                    and address_in_use(
                        self.sink.recent(FAILURE_LOG_LINES),
                        generation_note(self.name, self.generation),
                    )
                    and self.on_address_in_use
                ):
                    self.on_address_in_use()
                    self._relaunch_reason = "address in use before first healthy: new ports"
                    return False, "relaunch"
                return False, exit_reason(engine) + " before becoming healthy"
            if await self._probe(client):
                if answered_by_engine(engine, urlsplit(self.health_url()).port):
                    return True, None
                if self._port_taken():
                    return False, "relaunch"
            over = startup_over(
                self.policy, self.watch, start, trio.current_time(), self.health_url()
            )
            if over is not None:
                self._fail(over)
                return False, None
            await self._sleep_or_wake(policy.probe_startup_interval_s)

    def _port_taken(self) -> bool:
        """Another process answered on the engine's port: whether that means new ports now."""
        # A probed-free port can be taken by another process before a slow engine binds
        # it: that process's 200 is not our engine's, and our engine will never bind.
        self.log.warning(
            "%s: %s answered, but not from the engine's own process tree: the port was "
            "taken by another process",
            self.name,
            self.health_url(),
        )
        if not self.ever_healthy and self.on_address_in_use:
            self.on_address_in_use()
            self._relaunch_reason = "port taken by another process: new ports"
            return True
        return False

    async def _while_healthy(
        self, client: httpx.AsyncClient, engine: ProcessHandle, exited: trio.Event
    ) -> str | None:
        """Liveness: N consecutive failures -> unhealthy -> restart; what ended it."""
        policy = self.policy
        failures = 0
        while True:
            await self._sleep_or_wake(policy.probe_interval_s)
            if self._relaunch_reason is not None:
                return "relaunch"
            if exited.is_set():
                return exit_reason(engine)
            if await self._probe(client):
                failures = 0
                if self.patience is not None:
                    self.patience.answered()
                continue
            if exited.is_set():
                return exit_reason(engine)
            if self.patience is not None and await self.patience.excuse(client):
                continue
            failures += 1
            self.log.info(
                "%s: health probe failed (%d/%d)",
                self.name,
                failures,
                policy.probe_failure_threshold,
            )
            if failures >= policy.probe_failure_threshold:
                reason = f"{failures} consecutive health probe failures ({self.health_url()})"
                self._set("unhealthy", reason)
                return reason


def _stopped_note(engine: ProcessHandle | None) -> str:
    """The marker line of a requested stop, with how the engine ended once it has."""
    if engine is not None and engine.returncode is not None:
        return f"stopped on request (engine pid {engine.pid} {ended(engine.returncode)})"
    return "stopped on request"
