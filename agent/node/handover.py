"""A hand-over: one engine replaced by a new generation on the same ports, the old one finishing
what it serves beside it (docs/agent.md, "Engine states").

The steps, for the router (whose SIGTERM closes its listener at once, then waits for its
in-flight streams):

1. the old engine gets SIGTERM and drains in the background, its output still logged;
2. the new one is started the moment the old one's listening ports are free (bounded by the stop
   grace), and proven: its supervisor's startup probe, then, for the router, the head's canaries
   (``agent.head.proof``: the job is ``degraded`` until they pass);
3. the switch: whoever sends it requests asks for its address at each try and waits while it is
   ``restarting`` (the front door, ``agent.front.proxy``);
4. the old one ends when its streams are done, or is SIGKILLed after ``drain_s`` (cut to the stop
   grace when the supervisor stops meanwhile).

``HandOver`` holds these for one ``EngineSupervisor`` (``relaunch(handover=True)``): the head's
router uses it today; anything that restarts a server in front of clients (a service front) can.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from agent.launch import ProcessHandle
from agent.node.logpump import LogSink
from agent.node.ports import is_bindable

PORT_FREE_POLL_S = 0.01  # a hand-over's new engine starts this soon after the old one's listener


class HandOver:
    """The hand-overs of one supervised engine: asked, waited for (ports), drained."""

    def __init__(
        self,
        *,
        name: str,
        sink: LogSink,
        log: logging.Logger,
        ports: Callable[[], dict[str, int]],
        drain_s: float,
        grace_s: float,
    ) -> None:
        self.name = name
        self.sink = sink
        self.log = log
        self.ports = ports
        # How long a handed-over engine may finish what it serves (not capped by Slurm's KillWait
        # as the stop grace is: the job goes on meanwhile); never less than the stop grace.
        self.drain_s = max(drain_s, grace_s)
        self.grace_s = grace_s
        self.asked = False  # the next relaunch is a hand-over
        self._await_ports = False  # the next generation waits for the old one's ports
        self._drains: trio.Nursery | None = None
        self._draining: set[trio.CancelScope] = set()

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """The scope the handed-over engines drain in: it ends once every one has ended."""
        async with trio.open_nursery() as drains:
            self._drains = drains
            yield

    def take(self, engine: ProcessHandle, pumped: trio.Event, *, stopping: bool) -> bool:
        """Step 1, as a generation ends: when a hand-over was asked (and the supervisor is not
        stopping), let the old engine drain beside the next generation; whether it did."""
        drains = self._drains
        if not self.asked or drains is None or stopping or engine.returncode is not None:
            return False
        self.asked, self._await_ports = False, True
        drains.start_soon(self._drain, engine, pumped)
        return True

    async def ports_free(self) -> None:
        """Step 2, before the new engine: wait (bounded by the grace) until the old one has
        closed its listening ports, or the new one would fail with "address already in use"."""
        if not self._await_ports:
            return
        self._await_ports = False
        with trio.move_on_after(self.grace_s):
            # Polled: nothing signals that another process closed a socket.
            while True:
                if all(is_bindable(port) for port in self.ports().values()):
                    return
                await trio.sleep(PORT_FREE_POLL_S)

    def cut(self) -> None:
        """The supervisor stops: an engine still draining gets the stop grace from now, no
        more."""
        for scope in self._draining:
            scope.deadline = min(scope.deadline, trio.current_time() + self.grace_s)

    async def _drain(self, engine: ProcessHandle, pumped: trio.Event) -> None:
        """Step 4: SIGTERM now, its output still logged, SIGKILL after ``drain_s``."""
        async with trio.open_nursery() as nursery:

            async def pump() -> None:
                await pumped.wait()  # the generation's own pump has let go of the pipe
                await self.sink.pump(engine.output)

            nursery.start_soon(pump)
            with trio.CancelScope(deadline=trio.current_time() + self.drain_s) as scope:
                self._draining.add(scope)
                code = await engine.stop(self.drain_s)
            self._draining.discard(scope)
            if scope.cancelled_caught:
                engine.kill()
                code = await engine.wait()
            self.log.info(
                "%s: handed-over engine pid %s ended with status %d", self.name, engine.pid, code
            )
            with trio.move_on_after(2.0):
                await engine.wait()
            nursery.cancel_scope.cancel()
