"""A TileRT decode's own figures, from what it gives: its log lines and ``/decode_status``.

TileRT's decode has no ``/metrics``. Per successful request it logs one ``REQSTAT`` line
(``decode_server.py:106 [INFO]: REQSTAT rid=R seq=S completion=C wire_wait=.. convert=..
inject=.. decode=.. finish_reason=..``, times in ms); its refusals of kind 499, 500, 501 and 400
have lines of their own; 429 and 504 it never logs (the router does: ``RouterRefusals``).
``DecodeStats.feed`` takes the blocks of lines as the log pump reads them (no second read of the
file); ``poll_decode_status`` samples ``/decode_status`` for the busy time. ``PoolFigures`` is the
router's decode pool (``/pool_status``), polled by the head. docs/metrics.md names the series.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import trio

from agent.job.names import agent_names
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import RouterTokenize
from agent.node.rendezvous import read_records

_log = logging.getLogger(__name__)

# TileRT's format (pd_vllm/decode_server.py _log_reqstat), anywhere in a line (a launcher may
# prefix it): the fixed fields, then ``key=value`` pairs.
REQSTAT = re.compile(
    rb"REQSTAT rid=(?P<rid>\S+) seq=(?P<seq>\d+) completion=(?P<completion>\d+)"
    rb"(?P<rest>(?: \w+=\S+)*)\r?$",
    re.MULTILINE,
)
_PAIR = re.compile(rb"(\w+)=(\S+)")
# The decode's own lines for the refusals it logs (pd_vllm/decode_server.py); the typed ones end
# in ``(<error_type>)``.
_REFUSAL = re.compile(
    rb"(?P<cancelled>cancelled during KV transfer for \S+)"
    rb"|(?P<internal>(?:grammar prepare|prepare|decode|stream decode) failed for \S+)"
    rb"|(?:sampling|grammar) rejected for \S+: .*\((?P<error_type>\w+)\)\r?$"
    rb"|(?P<logprobs>logprobs requested but unsupported by )",
    re.MULTILINE,
)
_REFUSAL_NEEDLES = (b"cancelled during", b"failed for ", b"rejected for ", b"logprobs requested")
# TileRT's typed errors (pd_vllm/capabilities.py, grammar_spec.py): the HTTP status of each.
ERROR_TYPE_STATUS = {
    "capability_unavailable": 501,
    "logprobs_unavailable": 501,
    "grammar_unsupported": 501,
    "invalid_parameter": 400,
    "invalid_grammar": 400,
    "grammar_violation": 400,
    "grammar_backend_unavailable": 500,
}
# Error kinds by HTTP status, the label of tilert_decode_errors_total.
KIND_OF_STATUS = {
    429: "busy",
    504: "kv_transfer_timeout",
    499: "cancelled",
    501: "unsupported",
    500: "internal",
    400: "invalid",
}
# Seconds; the decode's stages run from sub-millisecond (inject) to minutes (a long decode).
TIME_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# The REQSTAT field of each stage, and the histogram it goes into.
STAGES = {
    "wire_wait": "transfer_wait",
    "convert": "conversion",
    "inject": "injection",
    "decode": "generation",
}
DECODE_STATUS_POLL_S = 1.0
# A router busy serving (its /pool_status runs in its thread pool) may miss one poll's timeout on
# a loaded machine: that is not a change of its pool, so the last answer stands this long.
POOL_KEEP_S = 5.0


@dataclass
class Histogram:
    """Cumulative-ready bucket counts, a sum and a count (rendered by agent.http.decodemetrics)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Count one value (the last slot is +Inf)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, ``+Inf`` last, as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


def _ms(value: bytes | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value) / 1000.0
    except ValueError:
        return None


@dataclass
class DecodeStats:
    """What one decode did, counted from its log lines and its ``/decode_status``."""

    requests: dict[str, int] = field(default_factory=dict)  # by outcome
    prompt_tokens: int = 0
    output_tokens: int = 0
    stages: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(TIME_BUCKETS) for name in STAGES.values()}
    )
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    errors: dict[int, int] = field(default_factory=dict)  # by HTTP status
    busy_seconds: float = 0.0
    busy: bool | None = None  # the last /decode_status answer; None: none yet
    status_polls: dict[str, int] = field(default_factory=dict)  # busy, idle, failed

    def __post_init__(self) -> None:
        self._stage_of = [(key.encode(), self.stages[name]) for key, name in STAGES.items()]

    def feed(self, block: bytes) -> None:
        """Count the REQSTAT and refusal lines of a block of whole lines (a log pump watcher)."""
        # Every line counted here comes from TileRT's decode_server logger, whose lines name it
        # (``decode_server.py:106 [INFO]: ...``, or ``pd_vllm.decode_server`` in the asctime format
        # of its main): one cheap pass keeps a flood of other lines from costing five.
        if b"decode_server" not in block:
            return
        if b"REQSTAT " in block:
            for m in REQSTAT.finditer(block):
                self._count(int(m["seq"]), int(m["completion"]), dict(_PAIR.findall(m["rest"])))
        if any(needle in block for needle in _REFUSAL_NEEDLES):
            for m in _REFUSAL.finditer(block):
                self._refusal(m)

    def _count(self, seq: int, completion: int, fields: dict[bytes, bytes]) -> None:
        # On the log pump's path, once per request: bytes as read, no Struct in between.
        outcome = fields.get(b"finish_reason", b"unknown").decode("utf-8", "replace")
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
        self.prompt_tokens += seq
        self.output_tokens += completion
        for key, histogram in self._stage_of:
            seconds = _ms(fields.get(key))
            if seconds is not None:
                histogram.observe(seconds)
        decode = _ms(fields.get(b"decode"))
        # The first token is the prefill's: the decode made completion - 1 of them.
        if decode is not None and completion > 1:
            self.tpot.observe(decode / (completion - 1))

    def _refusal(self, m: re.Match[bytes]) -> None:
        if m["cancelled"]:
            status = 499
        elif m["internal"]:
            status = 500
        elif m["logprobs"]:
            status = 501
        else:
            status = ERROR_TYPE_STATUS.get(m["error_type"].decode(), 400)
        self.count_error(status)

    def count_error(self, status: int) -> None:
        """Count one refused request of HTTP ``status``."""
        self.errors[status] = self.errors.get(status, 0) + 1
        self.requests["error"] = self.requests.get("error", 0) + 1

    def sample(self, busy: bool | None, seconds: float) -> None:
        """One ``/decode_status`` answer (None: no answer), ``seconds`` after the last one.

        The interval is credited to the state seen at its start: a sampled busy time whose rate
        is the busy fraction.
        """
        if self.busy:
            self.busy_seconds += seconds
        self.busy = busy
        key = "failed" if busy is None else "busy" if busy else "idle"
        self.status_polls[key] = self.status_polls.get(key, 0) + 1


class _DecodeStatus(msgspec.Struct):
    status: str
    current_rid: str | None = None


async def poll_decode_status(
    stats: DecodeStats,
    client: httpx.AsyncClient,
    url: Callable[[], str],
    serving: Callable[[], bool],
    *,
    interval_s: float = DECODE_STATUS_POLL_S,
    timeout_s: float = 2.0,
) -> None:
    """Sample ``url`` (the decode's ``/decode_status``) every ``interval_s`` while ``serving()``;
    runs until cancelled."""
    last = trio.current_time()  # the clock of the sleeps between samples
    while True:
        await trio.sleep(interval_s)
        now = trio.current_time()
        if not serving():
            stats.busy, last = None, now
            continue
        busy: bool | None
        try:
            response = await client.get(url(), timeout=timeout_s)
            busy = msgspec.json.decode(response.content, type=_DecodeStatus).status == "busy"
        except (httpx.HTTPError, OSError, msgspec.DecodeError, msgspec.ValidationError):
            busy = None
        stats.sample(busy, now - last)
        last = now


# The router's lines for a decode's 429 (after its retry) and other refusals
# (pd_vllm/pd_router.py _log_refusal): the node is named by its HTTP base URL.
_ROUTER_REFUSAL = re.compile(
    rb"decode node (?P<node>\S+) (?:(?P<busy>still busy) for \S+ after \d+ attempts"
    rb"|returned (?P<status>\d+) for )"
)


class _PoolNode(msgspec.Struct):
    host: str
    busy: bool


class _PoolStatus(msgspec.Struct):
    nodes: list[_PoolNode]
    router_tokenize: RouterTokenize | None = None


@dataclass
class PoolFigures:
    """The router's view of its decodes: the pool (``/pool_status``) and the refusals it logged."""

    # decode HTTP base URL -> {status: count}, from the router's log.
    refusals: dict[str, dict[int, int]] = field(default_factory=dict)
    free: int | None = None
    busy: int | None = None
    answered_at: float | None = None  # trio's clock: the last readable /pool_status
    # The router's own tokenization (None: not armed, or no router answers).
    tokenize: RouterTokenize | None = None

    def feed(self, block: bytes) -> None:
        """Count the router's refusal lines in a block of its log (a log pump watcher)."""
        if b"decode node " not in block:
            return
        for m in _ROUTER_REFUSAL.finditer(block):
            status = 429 if m["busy"] else int(m["status"])
            node = self.refusals.setdefault(m["node"].decode("utf-8", "replace"), {})
            node[status] = node.get(status, 0) + 1

    def pool(self, raw: bytes | None, now: float) -> None:
        """Take one ``/pool_status`` answer at ``now``; None or unreadable keeps the last one
        for ``POOL_KEEP_S``, then the pool is unknown."""
        try:
            status = msgspec.json.decode(raw, type=_PoolStatus) if raw else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            status = None
        if status is None:
            if self.answered_at is None or now - self.answered_at >= POOL_KEEP_S:
                self.forget()
            return
        self.answered_at = now
        nodes, self.tokenize = status.nodes, status.router_tokenize
        self.busy = sum(1 for n in nodes if n.busy)
        self.free = len(nodes) - self.busy

    def forget(self) -> None:
        """No router runs: the pool is unknown at once."""
        self.free = self.busy = self.answered_at = self.tokenize = None


async def poll_pool_status(
    figures: PoolFigures,
    client: httpx.AsyncClient,
    url: Callable[[], str | None],
    *,
    interval_s: float = DECODE_STATUS_POLL_S,
    timeout_s: float = 2.0,
) -> None:
    """Read the router's ``/pool_status`` every ``interval_s`` (None from ``url``: not running)."""
    while True:
        target = url()
        if target is None:
            figures.forget()
        else:
            raw: bytes | None = None
            try:
                response = await client.get(target, timeout=timeout_s)
                raw = response.content if response.status_code == 200 else None
            except (httpx.HTTPError, OSError):
                raw = None
            figures.pool(raw, trio.current_time())
        await trio.sleep(interval_s)


def decode_namer(job: JobDir, plan: Plan) -> Callable[[str], str]:
    """A decode's HTTP base URL as the router names it -> its agent's name (else the URL); the
    records are read again only for a URL not seen yet."""
    known: dict[str, str] = {}

    def name(url: str) -> str:
        if url not in known:
            names = agent_names(plan.prefill.workers, plan.decode.workers)
            for rec in read_records(job, set(names)).by_name.values():
                if rec.role == "decode" and "http" in rec.ports:
                    known[f"http://{rec.address}:{rec.ports['http']}"] = rec.name
        return known.get(url, url)

    return name
