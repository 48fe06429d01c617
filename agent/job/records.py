"""Formats that cross processes and nodes: rendezvous records, agent ``/status``, ``status.json``.

The field names are contracts (docs/agent.md); other people's tools read these files.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from agent.job.benchmark import BenchmarkStatus
from agent.job.vocab import (
    FINAL_STATES,
    AgentState,
    EngineState,
    ExitState,
    JobState,
    PoolState,
    Process,
    Role,
)

RECORD_SCHEMA = 1
# Linux's largest pid_max.
PID_MAX = 4_194_304


class AgentExit(msgspec.Struct, kw_only=True):
    """An agent's last word in its record: it has exited, ``failed`` or ``stopped``, and why.

    Without it the head could only tell a dead peer by its silence (after a bound of seconds); an
    agent that fails at start says so and the head takes it as failed at once.
    """

    state: ExitState
    reason: str
    code: int
    at: float = msgspec.field(default_factory=time.time)


class RendezvousRecord(msgspec.Struct, kw_only=True):
    """``J/rendezvous/<name>.json``: who is where. Written on port choice, on every port change,
    and once more with ``exited`` when the agent exits."""

    schema: int = RECORD_SCHEMA
    name: str
    role: Role
    index: int
    node: str
    address: str
    # engine "http", decode "ctrl", "agent", and "router" for prefill-0.
    ports: dict[str, int]
    status_url: str
    metrics_url: str
    # Engine software detected by the preflight, e.g. {"tilert": "0.1.6.post3", "vllm": "0.11.0"}.
    versions: dict[str, str] = {}
    updated_at: float = msgspec.field(default_factory=time.time)
    # The Slurm job the agent runs in (a pool grown by ``tilert-submit scale`` has a second one).
    slurm_job_id: str | None = None
    # Set by the agent as it exits; absent while it runs.
    exited: AgentExit | None = None


class ConvertProgress(msgspec.Struct, kw_only=True):
    """A weights conversion seen by a decode agent: its own, or the one it waits for."""

    # The weights folder (as the agent's node sees it).
    folder: str
    # Whether this agent runs the converter ("converting") or waits for the holder ("waiting").
    role: Literal["converting", "waiting"]
    # The lock holder: agent name, node and job directory.
    holder: str
    holder_node: str
    holder_job: str
    # Bytes the converter has written so far, and the recent rate (bytes per second).
    bytes_written: int
    rate_bytes_s: float
    started_at: float


class EngineStatus(msgspec.Struct, kw_only=True):
    """The supervised state of one engine (the role's engine, or the router in prefill-0)."""

    state: EngineState
    pid: int | None
    ports: dict[str, int]
    restarts: int
    reason: str
    since: float
    uptime_s: float | None
    # Wall clock (this node's) of the health answer that made the engine healthy; None unless
    # healthy. The head's gate figure starts at the last worker's.
    healthy_at: float | None = None
    # While starting: the engine log's last progress line (weights, shards, compile, graph
    # capture) and when it came (wall clock); None otherwise.
    progress: str | None = None
    progress_at: float | None = None


class AgentStatus(EngineStatus, kw_only=True):
    """An agent's ``/status``: identity plus its engine's state; prefill-0 adds ``router``."""

    name: str
    role: Role
    index: int
    node: str
    # Increases on every change; long-poll with ``/status?after=<version>``.
    version: int = 0
    router: EngineStatus | None = None
    # While ``converting``: the conversion's progress.
    convert: ConvertProgress | None = None
    # What the agent cannot do without stopping its engine, e.g. write into the job directory
    # (full, read-only, removed); served only when there is something to say.
    problems: list[str] = []


class JobAgent(msgspec.Struct, kw_only=True):
    """A row of ``status.json``: an agent (or the router) as the head sees it."""

    name: str
    role: Process
    index: int
    node: str | None
    state: AgentState
    restarts: int
    reason: str
    log: str
    metrics_url: str | None
    status_url: str | None
    # While the agent is ``converting``: the conversion's progress; absent otherwise.
    convert: ConvertProgress | msgspec.UnsetType = msgspec.UNSET
    # While starting: the engine log's last progress line and when it came; absent otherwise.
    progress: str | msgspec.UnsetType = msgspec.UNSET
    progress_at: float | msgspec.UnsetType = msgspec.UNSET
    # A decode: how often the head took it back into the router after dropping it, and the last
    # word on that (why it was taken back, or why it stays out); docs/agent.md, "Rejoin".
    rejoins: int = 0
    rejoin_reason: str | None = None
    # A decode: its place in the pool (``tilert-submit scale``) and since when (Unix seconds), the
    # Slurm job it runs in; absent for the prefill and the router.
    pool: PoolState | msgspec.UnsetType = msgspec.UNSET
    pool_since: float | msgspec.UnsetType = msgspec.UNSET
    slurm_job_id: str | msgspec.UnsetType | None = msgspec.UNSET


class Gate(msgspec.Struct, kw_only=True):
    """``status.json`` ``gate``: how long the router took to start once every worker was healthy."""

    # The worker that turned healthy last, and when, on its own clock (its /status healthy_at).
    last_worker: str
    last_healthy_at: float
    # The head's clock once the router's process was running (its launcher returned after exec).
    router_started_at: float
    # router_started_at - last_healthy_at: what users wait for (clocks of two nodes when the last
    # worker is a decode: NTP keeps them within about a millisecond).
    gate_s: float
    # The head's own part: it saw the last worker healthy -> it asked for the router's start.
    decision_s: float


class QueueSummary(msgspec.Struct, kw_only=True):
    """The front's admission queue now (status.json ``front.queue``, agent.front.queue)."""

    waiting: int = 0
    # How long the request at the queue's head has waited (s).
    oldest_wait_s: float = 0.0
    # Requests (and canaries) at the router now, and how many it may take at once (its decodes).
    admitted: int = 0
    capacity: int = 0
    # reason (full: max_waiting, wait: max_wait_s) -> requests answered 429 since the head started
    refused: dict[str, int] = {}


class FrontSummary(msgspec.Struct, kw_only=True):
    """The front door's request counts since the head started (status.json ``front``)."""

    # outcome (ok, retried_ok, resumed, failed, truncated, rejected, cancelled) -> requests
    requests: dict[str, int] = {}
    # reason (connect, status_502, busy, stream_error, ...) -> tries again
    retries: dict[str, int] = {}
    in_flight: int = 0
    queue: QueueSummary = msgspec.field(default_factory=QueueSummary)


class RouterTokenize(msgspec.Struct, kw_only=True):
    """TileRT 0.1.6.post3's router-side tokenization as its ``/pool_status`` says
    (``router_tokenize``; status.json ``router_tokenize``): on (armed and self-checked), chats it
    tokenized, and of those the ones that fell back to vLLM's chat path."""

    on: bool
    requests: int = 0
    fallback: int = 0


class JobStatus(msgspec.Struct, kw_only=True):
    """``J/status.json``: the submitter writes ``pending``; the head agent every change and every 5
    s."""

    state: JobState
    model: str
    router_url: str | None = None
    # The front door (the head agent's, agent.front.port): the job's one stable client address.
    front_url: str | None = None
    # What the front door has seen (absent before the head runs one).
    front: FrontSummary | None = None
    # Both are acted on by `tilert-submit stop` (scancel ID, kill PID): a status.json with
    # anything else is refused when it is read (a pid of -1 would signal every process).
    slurm_job_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,20}$")] | None = None
    local_pid: Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)] | None = None
    # The ``--local`` supervisor's start time (psutil ``create_time``): ``stop`` signals
    # ``local_pid`` only while it still names the process that started then.
    local_started_at: float | None = None
    updated_at: float = msgspec.field(default_factory=time.time)
    error: str | None = None
    # Why the job ended when nobody stopped it and nothing failed: ``time_limit`` (a ``--local``
    # job's slurm.time_limit came; its supervisor writes it last). None otherwise, and always
    # under Slurm (squeue/sacct say TIMEOUT there).
    ended_by: Literal["time_limit"] | None = None
    agents: list[JobAgent] = []
    # The router, supervised by prefill-0 (not an agent of its own; ``logs J router`` shows it).
    router: JobAgent | None = None
    # The processes that are the project's stand-ins (``--mock``): the plan's, the router only
    # once the head found it cannot run the real one.
    standins: list[str] = []
    # The benchmark the head runs once ready (docs/benchmark.md); absent without one.
    benchmark: BenchmarkStatus | msgspec.UnsetType = msgspec.UNSET
    # The router's own tokenization (TileRT 0.1.6.post3), while its /pool_status shows it.
    router_tokenize: RouterTokenize | None = None
    # Once the router has started (bring-up only; a restart without a dropped decode is no gate).
    gate: Gate | msgspec.UnsetType = msgspec.UNSET


def with_last_states(status: JobStatus, why: str) -> JobStatus:
    """``status`` of a job that has ended, every agent and the router in its last state: one
    still shown running (its last word missed) is ``stopped`` with ``why`` and what it last said.
    A ``failed`` one keeps its reason."""

    def last(entry: JobAgent) -> JobAgent:
        if entry.state in FINAL_STATES:
            return entry
        said = f" (it last said {entry.state}: {entry.reason})" if entry.reason else ""
        return msgspec.structs.replace(entry, state="stopped", reason=f"{why}{said}")

    return msgspec.structs.replace(
        status,
        agents=[last(a) for a in status.agents],
        router=last(status.router) if status.router is not None else None,
    )
