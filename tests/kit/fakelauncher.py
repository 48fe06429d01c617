"""An in-memory launcher: scripted engines that exit and answer health checks as told, no process.

The ``Launcher`` and ``ProcessHandle`` protocols of ``agent/launch/spec.py``, the way httpx's
``MockTransport`` stands in for a network: each ``start`` takes the next ``Engine`` of the script
(the last one repeats) and returns a ``FakeProcess`` that prints its lines, answers ``/health``
once ``healthy_after`` has passed and exits with ``code`` after ``exit_after``, all on trio's
clock (with pytest-trio's ``autojump_clock`` no real time passes). ``health_transport`` is the
``httpx.MockTransport`` that answers for the process started last, so a supervisor's probes see
the scripted engine. ``run`` answers short commands (a preflight) from ``answers``. ``InlineSink``
is the ``LogSink`` for a supervisor on that clock: it writes its file on the loop, because a
worker thread makes the clock jump (docs/testing.md, "Worker threads and the autojump clock").

Use it for what the supervisor and the head decide (restart, backoff, give up, gate); what a real
process does (process groups, signals, pipes) stays with the real launchers' tests
(tests/test_launchers.py, tests/test_supervisor.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import psutil
import trio
import trio.testing

from agent.launch import LaunchSpec
from agent.node.logpump import LogSink


class InlineSink(LogSink):
    """A ``LogSink`` that writes its file on the loop's thread, for trio's autojump clock.

    That clock jumps to the next deadline whenever no task can run, and a task waiting for a
    worker thread cannot: a write in a thread let the clock pass every deadline up to the test's
    own ``fail_after`` while the thread took a few real milliseconds.
    """

    write_in_thread = False


@dataclass(frozen=True)
class Engine:
    """One generation's script: what it prints, when it is healthy, when and how it exits."""

    lines: tuple[str, ...] = ()
    healthy_after: float | None = 0.0  # seconds after start; None: never healthy
    exit_after: float | None = None  # seconds after start; None: runs until stopped
    code: int = 1  # the exit status when it exits by itself
    ignores_sigterm: bool = False  # a stop then ends it with SIGKILL after the grace


class FakeProcess:
    """A ``ProcessHandle`` that follows an ``Engine`` script on trio's clock."""

    _next_pid = 40_000

    def __init__(self, spec: LaunchSpec, engine: Engine) -> None:
        FakeProcess._next_pid += 1
        self.spec = spec
        self.engine = engine
        self._pid = FakeProcess._next_pid
        self._returncode: int | None = None
        self._ended = trio.Event()
        self.started_at = trio.current_time()
        stream = trio.testing.MemoryReceiveStream()
        for line in engine.lines:
            stream.put_data(line.encode() + b"\n")
        self.output: trio.abc.ReceiveStream = stream
        self._stream = stream
        self.signals: list[signal.Signals] = []

    @property
    def pid(self) -> int | None:
        """A made-up pid (no process on this machine has to exist for it)."""
        return self._pid

    @property
    def returncode(self) -> int | None:
        """The scripted exit status once it ended."""
        if self._returncode is None and self._due(self.engine.exit_after):
            self._end(self.engine.code)
        return self._returncode

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        return self.returncode is None and self._due(self.engine.healthy_after)

    def _due(self, after: float | None) -> bool:
        return after is not None and trio.current_time() >= self.started_at + after

    def _end(self, code: int) -> None:
        if self._returncode is None:
            self._returncode = code
            self._stream.put_eof()
            self._ended.set()

    async def wait(self) -> int:
        """Until the script's exit, or a stop."""
        if self.engine.exit_after is not None:
            with trio.move_on_at(self.started_at + self.engine.exit_after):
                await self._ended.wait()
        else:
            await self._ended.wait()
        self._end(self.engine.code)
        assert self._returncode is not None
        return self._returncode

    async def stop(self, grace_s: float) -> int:
        """SIGTERM; an engine that ignores it is SIGKILLed after ``grace_s``."""
        if self.returncode is not None:
            return self.returncode
        self.signals.append(signal.SIGTERM)
        if self.engine.ignores_sigterm:
            with trio.move_on_after(grace_s):
                await self._ended.wait()
            self.kill()
        self._end(-signal.SIGTERM)
        return await self.wait()

    def kill(self) -> None:
        """SIGKILL: ends it now."""
        if self._returncode is None:
            self.signals.append(signal.SIGKILL)
            self._end(-signal.SIGKILL)

    def descendants(self) -> list[psutil.Process]:
        """No real process tree (the supervisor then trusts the health answer)."""
        return []


@dataclass
class FakeLauncher:
    """A ``Launcher`` whose engines follow ``script``; it records every spec it was given."""

    script: Sequence[Engine] = (Engine(),)
    answers: Callable[[LaunchSpec], tuple[int, bytes]] = lambda _spec: (0, b"")
    name: str = "fake"
    started: list[FakeProcess] = field(default_factory=list)
    ran: list[LaunchSpec] = field(default_factory=list)

    async def start(self, spec: LaunchSpec) -> FakeProcess:
        """The next engine of the script (the last repeats)."""
        engine = self.script[min(len(self.started), len(self.script) - 1)]
        process = FakeProcess(spec, engine)
        self.started.append(process)
        return process

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:  # noqa: ARG002 (the answer is immediate)
        """The scripted answer to a short command."""
        self.ran.append(spec)
        return self.answers(spec)

    @property
    def current(self) -> FakeProcess | None:
        """The process started last."""
        return self.started[-1] if self.started else None

    def health_transport(self) -> httpx.MockTransport:
        """Answers any request as the last started engine's ``/health``: 200 or refused."""

        def handle(request: httpx.Request) -> httpx.Response:
            process = self.current
            if process is None or not process.healthy():
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200)

        return httpx.MockTransport(handle)
