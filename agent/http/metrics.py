"""The agent's own Prometheus page (``tilert_agent_*``), read from live state at scrape time.

TileRT decode and the router have no ``/metrics``: these series are the only view of them. Every
series carries ``role``, ``node`` and ``slurm_job_id`` (the page owns them, so the file_sd targets
add none); ``component`` tells the role's engine from the router in prefill-0. The page is served in
the classic text format (prometheus_client bug #1177 mangles ``vllm:`` names under OpenMetrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import psutil
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from agent.http.decodemetrics import FAMILIES as DECODE_FAMILIES
from agent.http.decodemetrics import DecodeCollector, PoolCollector
from agent.http.reexport import registry_names
from agent.job.records import EngineStatus
from agent.job.vocab import JOB_STATES, EngineState, JobState, Role
from agent.node.decodestats import DecodeStats, PoolFigures
from agent.node.supervisor import EngineSupervisor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Every engine state but ``converting`` (the series docs/metrics.md lists: no engine runs then).
ENGINE_STATES: Sequence[EngineState] = (
    "starting",
    "healthy",
    "unhealthy",
    "restarting",
    "failed",
    "stopping",
    "stopped",
)
BASE_LABELS = ("role", "node", "slurm_job_id")
# The head serves these only once it has measured them: reserved from the start all the same.
GATE = "tilert_agent_gate_seconds"
GATE_LATENCY = "tilert_agent_gate_latency_seconds"
CANARY_LATENCY = "tilert_agent_canary_latency_seconds"
TREE_TTL_S = 10.0


@dataclass
class HeadFigures:
    """What the head agent measures, for its extra series."""

    job_state: JobState = "starting"
    # Last worker's own healthy -> the router's process running (what users wait for).
    gate_s: float | None = None
    # The head's decision alone: it saw the last worker healthy -> it asked for the router.
    gate_latency_s: float | None = None
    canary_latency_s: list[float] = field(default_factory=list)


class _Trees:
    """Each engine's process tree, found again at most every ``TREE_TTL_S``.

    Finding a tree reads every process of the node (psutil's parent map: 1-10 ms with a few
    hundred processes) and every scrape wants it; the figures of the processes found are read
    fresh each time. A process the engine starts in between is counted from the next search.
    """

    def __init__(self) -> None:
        self._found: dict[str, tuple[float, int, list[psutil.Process]]] = {}

    def of(
        self, component: str, engine_pid: int | None, sup: EngineSupervisor
    ) -> list[psutil.Process]:
        """The processes of ``component``'s engine (none while it has no live pid)."""
        if engine_pid is None or sup.process is None:
            self._found.pop(component, None)
            return []
        now = time.monotonic()
        found = self._found.get(component)
        if found is None or found[1] != engine_pid or now - found[0] > TREE_TTL_S:
            try:
                tree = sup.process.descendants()
            except psutil.Error:
                tree = []
            found = self._found[component] = (now, engine_pid, tree)
        return found[2]


def _tree_figures(tree: Iterable[psutil.Process]) -> tuple[float, float, float, float, float]:
    """CPU seconds, RSS, threads, open files and processes of a process tree (gone ones skipped)."""
    c = r = t = f = n = 0.0
    for proc in tree:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                c += times.user + times.system
                r += proc.memory_info().rss
                t += proc.num_threads()
                f += proc.num_fds()
                n += 1
        except psutil.Error:
            continue
    return c, r, t, f, n


class _EngineFamilies:
    """The per-engine series of one scrape, one sample per supervised component."""

    def __init__(self) -> None:
        names = [*BASE_LABELS, "component"]
        self.state = GaugeMetricFamily(
            "tilert_agent_engine_state",
            "1 for the engine's current state",
            labels=[*names, "state"],
        )
        self.up = GaugeMetricFamily(
            "tilert_agent_engine_up", "1 when the engine is healthy", labels=names
        )
        self.restarts = CounterMetricFamily(
            "tilert_agent_engine_restarts", "Engine restarts by the agent", labels=names
        )
        self.healthy_after = GaugeMetricFamily(
            "tilert_agent_time_to_healthy_seconds",
            "Launch to first healthy answer, last generation",
            labels=names,
        )
        self.cpu = CounterMetricFamily(
            "tilert_agent_engine_cpu_seconds", "CPU time of the engine's process tree", labels=names
        )
        self.rss = GaugeMetricFamily(
            "tilert_agent_engine_resident_memory_bytes",
            "RSS of the engine's process tree",
            labels=names,
        )
        self.threads = GaugeMetricFamily(
            "tilert_agent_engine_threads", "Threads in the engine's process tree", labels=names
        )
        self.files = GaugeMetricFamily(
            "tilert_agent_engine_open_files",
            "Open files in the engine's process tree",
            labels=names,
        )
        self.procs = GaugeMetricFamily(
            "tilert_agent_engine_processes", "Processes in the engine's process tree", labels=names
        )
        self.log_lines = CounterMetricFamily(
            "tilert_agent_log_lines", "Engine log lines by outcome", labels=[*names, "outcome"]
        )
        self.log_bytes = CounterMetricFamily(
            "tilert_agent_log_bytes", "Engine log bytes by outcome", labels=[*names, "outcome"]
        )

    def add(
        self,
        labels: list[str],
        sup: EngineSupervisor,
        status: EngineStatus,
        tree: list[psutil.Process],
    ) -> None:
        """The samples of one engine: its state, restarts, process tree and log sink."""
        for s in ENGINE_STATES:
            self.state.add_metric([*labels, s], 1.0 if status.state == s else 0.0)
        self.up.add_metric(labels, 1.0 if status.state == "healthy" else 0.0)
        self.restarts.add_metric(labels, float(sup.restarts))
        if sup.stats.time_to_healthy_s is not None:
            self.healthy_after.add_metric(labels, sup.stats.time_to_healthy_s)
        c, r, t, f, n = _tree_figures(tree)
        self.cpu.add_metric(labels, c)
        self.rss.add_metric(labels, r)
        self.threads.add_metric(labels, t)
        self.files.add_metric(labels, f)
        self.procs.add_metric(labels, n)
        sink = sup.sink
        self.log_lines.add_metric([*labels, "written"], float(sink.lines_written))
        self.log_lines.add_metric([*labels, "dropped"], float(sink.lines_dropped))
        self.log_bytes.add_metric([*labels, "written"], float(sink.bytes_written))
        self.log_bytes.add_metric([*labels, "dropped"], float(sink.bytes_dropped))

    def families(self) -> Iterable[Metric]:
        """The families, in the page's order."""
        yield from (self.state, self.up, self.restarts, self.healthy_after, self.cpu, self.rss)
        yield from (self.threads, self.files, self.procs, self.log_lines, self.log_bytes)


def _gauge(name: str, documentation: str, base: list[str], value: float) -> GaugeMetricFamily:
    """A one-sample gauge labelled with the page's base labels."""
    family = GaugeMetricFamily(name, documentation, labels=list(BASE_LABELS))
    family.add_metric(base, value)
    return family


def _head_families(head: HeadFigures, base: list[str]) -> Iterable[Metric]:
    """The head agent's series: the job's state, then each figure once it has been measured."""
    job = GaugeMetricFamily(
        "tilert_agent_job_state",
        "1 for the job's current state",
        labels=[*BASE_LABELS, "state"],
    )
    for js in JOB_STATES:
        job.add_metric([*base, js], 1.0 if head.job_state == js else 0.0)
    yield job
    if head.gate_s is not None:
        yield _gauge(
            GATE,
            "Last worker's own healthy answer to the router's process running",
            base,
            head.gate_s,
        )
    if head.gate_latency_s is not None:
        yield _gauge(
            GATE_LATENCY,
            "The head saw the last worker healthy to the head asked for the router",
            base,
            head.gate_latency_s,
        )
    if head.canary_latency_s:
        yield _gauge(
            CANARY_LATENCY,
            "Latency of the last canary round, slowest request",
            base,
            max(head.canary_latency_s),
        )


class _StateCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self.m = metrics
        self.trees = _Trees()

    def describe(self) -> Iterable[Metric]:
        # Names are checked by the registry through describe(); the live values come later.
        return []

    def collect(self) -> Iterable[Metric]:
        m = self.m
        base = list(m.base.values())
        engines = _EngineFamilies()
        for component, sup in m.supervisors().items():
            status = sup.status()
            tree = self.trees.of(component, status.pid, sup)
            engines.add([*base, component], sup, status, tree)
        yield from engines.families()
        if m.upstream_up is not None:
            yield _gauge(
                "tilert_agent_upstream_up",
                "1 when the engine's own /metrics was fetched and parsed at this scrape",
                base,
                1.0 if m.upstream_up() else 0.0,
            )
        if m.head is not None:
            yield from _head_families(m.head, base)


class AgentMetrics:
    """The agent's registry: live state collectors plus the probe latency histogram."""

    def __init__(
        self,
        *,
        role: Role,
        node: str,
        slurm_job_id: str | None,
        supervisors: Callable[[], dict[str, EngineSupervisor]],
        upstream_up: Callable[[], bool] | None = None,
        head: HeadFigures | None = None,
        decode: DecodeStats | None = None,
        pool: tuple[PoolFigures, Callable[[str], str]] | None = None,
    ) -> None:
        # Outside Slurm the label still exists, so queries need no special case.
        self.base = {"role": role, "node": node, "slurm_job_id": slurm_job_id or "local"}
        self.supervisors = supervisors
        self.upstream_up = upstream_up
        self.head = head
        self.registry = CollectorRegistry(auto_describe=True)
        self.probe_latency = Histogram(
            "tilert_agent_probe_latency_seconds",
            "Health probe round-trip time",
            labelnames=[*BASE_LABELS, "component"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(self))
        if decode is not None:  # a decode agent: its engine's figures (tilert_decode_*)
            self.registry.register(DecodeCollector(decode, self.base))
        if pool is not None:  # the head: the router's decode pool and refusals
            self.registry.register(PoolCollector(pool[0], self.base, pool[1]))
        self.serves_decode = decode is not None or pool is not None

    def observer(self, component: str) -> Callable[[float], None]:
        """A callback that records one probe latency for ``component``."""
        child = self.probe_latency.labels(**self.base, component=component)
        return child.observe

    def family_names(self) -> set[str]:
        """Every family name this page serves or will serve (the re-export must never repeat one).

        Read once, before the head has measured anything, so the families it serves only later
        are added here: an upstream family of the same name would otherwise appear twice.
        """
        later = {GATE, GATE_LATENCY, CANARY_LATENCY} if self.head is not None else set()
        if self.serves_decode:
            later |= {
                f"{name}{suffix}"
                for name in DECODE_FAMILIES
                for suffix in ("", "_total", "_created", "_bucket", "_sum", "_count")
            }
        return registry_names(self.registry) | later

    def render(self) -> str:
        """The page in the classic text format."""
        return generate_latest(self.registry).decode()
