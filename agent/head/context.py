"""What the head needs from the node agent that runs it, handed over as one object.

The head is a part of prefill-0's node agent, yet it must not import it (the node agent imports
the head): the node agent builds a ``HeadContext`` and the head reads only that.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from agent.front import FrontFigures
from agent.http.longpoll import BarePoll, Fetch
from agent.http.metrics import HeadFigures
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentStatus
from agent.launch import Launcher
from agent.launch.jobspecs import SpecBuilder
from agent.node.decodestats import PoolFigures
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites


@dataclass(frozen=True)
class HeadContext:
    """The plan, the job, this node, and the node agent's hooks the head uses."""

    plan: Plan
    job: JobDir
    identity: Identity
    log: logging.Logger
    launcher: Launcher
    launch_spec: SpecBuilder
    # The head agent's own /status (its engine's state), read live.
    own_status: Callable[[], AgentStatus]
    # A supervised state changed: wake /status long-pollers and the head.
    on_change: Callable[[], None]
    # The prefill engine's base URL (its port may move before it first turns healthy).
    prefill_url: Callable[[], str]
    # What the head measures, for the agent's /metrics.
    figures: HeadFigures
    # component -> a callback recording one health probe latency.
    probe_observer: Callable[[str], Callable[[float], None]]
    # Stop everything this node runs: the router first, then the engine.
    stop_node: Callable[[], Awaitable[None]]
    # The node agent's writes into J/ (retried while they fail; the agent's /status shows them).
    writes: JobWrites
    # The agent's one HTTP client (agent.http.client): router probes, canaries.
    client: httpx.AsyncClient
    # process name -> its scratch folder (temp and caches; agent.launch.scratch), or None.
    scratch_folder: Callable[[str], str] | None = None
    # The job's state or its reason changed (systemd hears of it: agent.node.servicenotes).
    on_state: Callable[[], None] | None = None
    # The router's decode pool and the refusals it logs (tilert_decode_*): fed by its log.
    pool: PoolFigures | None = None
    # Makes the fetcher of one peer's /status long polls: a bare connection per peer
    # (agent.http.longpoll); tests pass one through a mock client.
    peer_fetch: Callable[[], Fetch] = BarePoll
    # The front door's bound socket (agent.front.port) and its figures; None: no front door.
    front_socket: socket.socket | None = None
    front_figures: FrontFigures | None = None
