"""What a node agent runs beside its engine: nothing for a worker (``Duties``), the head for
prefill-0 (``HeadDuties``: its figures, the router's port, the front door's socket, the ``Head``).

The node agent composes one of them and asks it the same questions whatever its role (which
supervisors to show, how the job stands, what to stop first); only ``HeadDuties`` knows the head.
It reads the node agent through ``NodeHooks`` (a description of the agent's parts, not an import
of it: the node agent imports the head).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx
import msgspec
import trio

from agent.front import FrontFigures
from agent.head.context import HeadContext
from agent.head.head import Head
from agent.http.endpoint import StatusFeed
from agent.http.metrics import AgentMetrics, HeadFigures
from agent.job.logfiles import log_path
from agent.job.names import BENCHMARK_NAME, ROUTER_NAME
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import EngineStatus
from agent.job.urls import router_url
from agent.launch import Launcher
from agent.launch.jobspecs import JobSpecs
from agent.launch.scratch import Scratch
from agent.node.decodestats import PoolFigures, decode_namer, poll_pool_status
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites
from agent.node.ports import choose_port, is_bindable
from agent.node.servicenotes import ServiceNotes, Standing
from agent.node.supervisor import EngineSupervisor
from agent.web.server import bound_socket

MAX_FRONT_PORT_TRIES = 50


class NodeHooks(Protocol):
    """The node agent's parts the head is built on (``agent.nodeagent.NodeAgent`` has them)."""

    job: JobDir
    plan: Plan
    id: Identity
    log: logging.Logger
    launcher: Launcher
    specs: JobSpecs
    feed: StatusFeed
    metrics: AgentMetrics
    writes: JobWrites
    client: httpx.AsyncClient
    scratch: Scratch
    notes: ServiceNotes
    bind_host: str

    def changed(self) -> None:
        """A supervised state changed: wake long-pollers, the head and systemd's notes."""

    def engine_url(self, path: str) -> str:
        """A URL on this node's engine HTTP port."""
        ...

    async def stop_all(self) -> None:
        """Stop what this node runs: the router first, then the engine."""


class Duties:
    """A worker's: nothing beside its engine (every answer empty)."""

    figures: HeadFigures | None = None
    # The router's decode pool and the refusals it logs, with the namer of its decodes.
    pool: tuple[PoolFigures, Callable[[str], str]] | None = None
    error: str | None = None  # why the duties failed the agent

    def attach(self, metrics: AgentMetrics) -> None:
        """Put the duties' own figures in the agent's one registry."""

    def start_problem(self) -> str | None:
        """Why the agent cannot start at all (said everywhere it must be); None: it can."""
        return None

    def bind(self, ports: dict[str, int], avoid: set[int]) -> None:
        """Take the duties' ports beside the agent's own (``ports``, published in its record)."""

    def supervisors(self) -> dict[str, EngineSupervisor]:
        """The supervisors run beside the engine (for /status and /metrics)."""
        return {}

    def router_status(self) -> EngineStatus | None:
        """The router's ``/status`` view once started (the head's only)."""
        return None

    def standing(self) -> Standing | None:
        """Where the job stands for systemd, when the duties say it (the head's is the job's)."""
        return None

    def log_files(self) -> dict[str, Path]:
        """The logs of what the duties run, by name (for ``/logs``)."""
        return {}

    def poke(self) -> None:
        """A supervised state changed."""

    def start(self, agent: NodeHooks, nursery: trio.Nursery) -> None:
        """Start what runs from the agent's start (before its engine)."""

    async def run(self) -> int | None:
        """The duties' life once the engine is on its way: the agent's exit code, or None (the
        agent serves until stopped)."""
        return None

    def request_stop(self) -> bool:
        """SIGTERM/SIGINT: whether the duties drain and stop the agent themselves."""
        return False

    def stop_note(self) -> str:
        """What a stop stops, in order (systemd's STOPPING status)."""
        return "the engine"

    async def stop(self) -> None:
        """Stop what runs beside the engine (before the engine: no request meets a stopping
        worker)."""


class HeadDuties(Duties):
    """Prefill-0's: the head, its router and its front door."""

    def __init__(self, job: JobDir, plan: Plan, identity: Identity, log: logging.Logger) -> None:
        self.job, self.plan, self.id, self.log = job, plan, identity, log
        self.head_figures = HeadFigures()
        self.figures = self.head_figures
        self.pool_figures = PoolFigures()
        self.pool = (self.pool_figures, decode_namer(job, plan))
        # The front door's socket (agent.front.port), bound with the agent's own port, and its
        # figures (tilert_front_*) in the agent's one registry.
        self.front_socket: socket.socket | None = None
        self.front_figures: FrontFigures | None = None
        self.head: Head | None = None

    def attach(self, metrics: AgentMetrics) -> None:
        """The front door's figures (tilert_front_*) in the agent's registry."""
        self.front_figures = FrontFigures(metrics.registry, metrics.base)

    def start_problem(self) -> str | None:
        """The head cannot serve on the router port: fail at once, in status.json too."""
        if is_bindable(self.plan.router.port):
            return None
        error = (
            f"router port {self.plan.router.port} is taken on {self.id.node}; free it or set "
            "agent.router_port (the benchmark and srtctl's scripts address the router there, so "
            "the agent does not move it)"
        )
        self.log.error("%s", error)
        # Nobody else writes status.json for this job now: say it here, or it stays pending.
        try:
            status = self.job.read_status()
            status.state, status.error, status.updated_at = "failed", error, time.time()
            self.job.write_status(status)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.log.error(
                "%s: cannot record the failure in %s: %s", self.id.name, self.job.status, exc
            )
        return error

    def bind(self, ports: dict[str, int], avoid: set[int]) -> None:
        """The router's port, and the front door's (agent.front.port, probed upward), fixed for
        the job's life: the head serves it."""
        ports["router"] = self.plan.router.port
        avoid = avoid | {ports["agent"], self.plan.router.port}
        start = self.plan.agent.front.port
        host = self.plan.agent.bind or self.id.address
        for _ in range(MAX_FRONT_PORT_TRIES):
            port = choose_port(start, avoid)
            try:
                self.front_socket = bound_socket(host, port)
                break
            except OSError:
                avoid.add(port)
        else:
            raise OSError(f"no free front port from {start} on {host} (agent.front.port)")
        ports["front"] = self.front_socket.getsockname()[1]

    def supervisors(self) -> dict[str, EngineSupervisor]:
        """The router's supervisor once started."""
        sup = self.head.router.supervisor if self.head is not None else None
        return {"router": sup} if sup is not None else {}

    def router_status(self) -> EngineStatus | None:
        """The router's ``/status`` view once started."""
        return self.head.router.status() if self.head is not None else None

    def standing(self) -> Standing | None:
        """The job's standing (ready once canaries proved it), once the head runs."""
        return self.head.standing() if self.head is not None else None

    def log_files(self) -> dict[str, Path]:
        """The router's log and the benchmark's."""
        return {
            ROUTER_NAME: log_path(self.job, ROUTER_NAME, plan=self.plan),
            BENCHMARK_NAME: log_path(self.job, BENCHMARK_NAME, plan=self.plan),
        }

    def poke(self) -> None:
        """Wake the head: re-evaluate now."""
        if self.head is not None:
            self.head.poke()

    def start(self, agent: NodeHooks, nursery: trio.Nursery) -> None:
        """Build the head on the agent's parts; poll the router's /pool_status while it is
        healthy (the tilert_decode_* pool figures)."""
        self.head = Head(self._context(agent))
        url = router_url(self.id.address, self.plan) + "/pool_status"

        def pool_url() -> str | None:
            sup = self.supervisors().get("router")
            return url if sup is not None and sup.state == "healthy" else None

        nursery.start_soon(poll_pool_status, self.pool_figures, agent.client, pool_url)

    def _context(self, agent: NodeHooks) -> HeadContext:
        return HeadContext(
            plan=self.plan,
            job=self.job,
            identity=self.id,
            log=self.log,
            launcher=agent.launcher,
            launch_spec=agent.specs,
            own_status=agent.feed.current,
            on_change=agent.changed,
            prefill_url=lambda: agent.engine_url(""),
            figures=self.head_figures,
            probe_observer=agent.metrics.observer,
            stop_node=agent.stop_all,
            writes=agent.writes,
            client=agent.client,
            scratch_folder=agent.scratch.folder,
            on_state=agent.notes.poke,
            pool=self.pool_figures,
            front_socket=self.front_socket,
            front_figures=self.front_figures,
        )

    async def run(self) -> int | None:
        """The head's whole life: the agent's exit code."""
        if self.head is None:
            return None
        code = await self.head.run()
        self.error = self.head.error
        return code

    def request_stop(self) -> bool:
        """The head drains and returns from ``run``."""
        if self.head is None:
            return False
        self.head.request_stop()
        return True

    def stop_note(self) -> str:
        """The router first, once the head runs."""
        return "the router, then the engine" if self.head is not None else "the engine"

    async def stop(self) -> None:
        """Stop the router (first, so no request meets a stopping worker)."""
        if self.head is not None:
            await self.head.stop()
