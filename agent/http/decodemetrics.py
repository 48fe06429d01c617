"""The ``tilert_decode_*`` series: a decode's figures (decode agent) and the router's pool (head),
with the router's own tokenization (``tilert_router_tokenize_*``).

Read at scrape time from ``agent.node.decodestats``; each series carries ``role``, ``node`` and
``slurm_job_id`` like the agent's own. docs/metrics.md documents every name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agent.job.records import RouterTokenize
from agent.node.decodestats import KIND_OF_STATUS, DecodeStats, Histogram, PoolFigures

# Every family this module may serve (the re-export must never repeat one).
FAMILIES = (
    "tilert_decode_requests",
    "tilert_decode_prompt_tokens",
    "tilert_decode_output_tokens",
    "tilert_decode_transfer_wait_seconds",
    "tilert_decode_conversion_seconds",
    "tilert_decode_injection_seconds",
    "tilert_decode_generation_seconds",
    "tilert_decode_time_per_output_token_seconds",
    "tilert_decode_errors",
    "tilert_decode_busy",
    "tilert_decode_busy_seconds",
    "tilert_decode_status_polls",
    "tilert_decode_pool_nodes",
    "tilert_router_tokenize_on",
    "tilert_router_tokenize_requests",
    "tilert_router_tokenize_fallbacks",
)
_STAGE_HELP = {
    "transfer_wait": "Wait for the KV of every sender rank after /pd/decode arrived (wire_wait)",
    "conversion": "KV dequantisation and relayout (convert)",
    "injection": "Copy of the KV into the engine's caches (inject)",
    "generation": "Injection end to decode end (decode)",
}


def _histogram(name: str, doc: str, labels: Sequence[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=list(labels))


def _add(family: HistogramMetricFamily, values: list[str], h: Histogram) -> None:
    family.add_metric(values, h.cumulative(), h.total)


def _kind(status: int) -> str:
    return KIND_OF_STATUS.get(status, "other")


class DecodeCollector(Collector):
    """A decode agent's ``tilert_decode_*`` series from its ``DecodeStats``."""

    def __init__(self, stats: DecodeStats, base: dict[str, str]) -> None:
        self.stats = stats
        self.base = base

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        names = list(self.base)
        base = list(self.base.values())
        requests = CounterMetricFamily(
            "tilert_decode_requests",
            "Requests the decode finished, by outcome (finish_reason, or error)",
            labels=[*names, "outcome"],
        )
        for outcome, n in sorted(s.requests.items()):
            requests.add_metric([*base, outcome], float(n))
        yield requests
        prompt = CounterMetricFamily(
            "tilert_decode_prompt_tokens",
            "Prompt tokens whose KV reached the decode (REQSTAT seq)",
            labels=names,
        )
        prompt.add_metric(base, float(s.prompt_tokens))
        output = CounterMetricFamily(
            "tilert_decode_output_tokens",
            "Tokens returned, the prefill's first token included (REQSTAT completion)",
            labels=names,
        )
        output.add_metric(base, float(s.output_tokens))
        yield from (prompt, output)
        for stage, h in s.stages.items():
            family = _histogram(f"tilert_decode_{stage}_seconds", _STAGE_HELP[stage], names)
            _add(family, base, h)
            yield family
        tpot = _histogram(
            "tilert_decode_time_per_output_token_seconds",
            "Generation time over the tokens the decode made (completion - 1)",
            names,
        )
        _add(tpot, base, s.tpot)
        yield tpot
        errors = CounterMetricFamily(
            "tilert_decode_errors",
            "Requests the decode refused or failed, by kind and HTTP status",
            labels=[*names, "kind", "code"],
        )
        for status in (499, 500, 501, 400):
            errors.add_metric([*base, _kind(status), str(status)], float(s.errors.get(status, 0)))
        yield errors
        busy_time = CounterMetricFamily(
            "tilert_decode_busy_seconds",
            "Time /decode_status said busy (sampled); its rate is the busy fraction",
            labels=names,
        )
        busy_time.add_metric(base, s.busy_seconds)
        yield busy_time
        if s.busy is not None:
            busy = GaugeMetricFamily(
                "tilert_decode_busy", "1 when the last /decode_status said busy", labels=names
            )
            busy.add_metric(base, 1.0 if s.busy else 0.0)
            yield busy
        polls = CounterMetricFamily(
            "tilert_decode_status_polls",
            "/decode_status answers by status (failed: no usable answer)",
            labels=[*names, "status"],
        )
        for answer in ("busy", "idle", "failed"):
            polls.add_metric([*base, answer], float(s.status_polls.get(answer, 0)))
        yield polls


class PoolCollector(Collector):
    """The head's view of the decodes through the router: its pool and the refusals it logged."""

    def __init__(
        self,
        figures: PoolFigures,
        base: dict[str, str],
        decode_name: Callable[[str], str],
    ) -> None:
        self.figures = figures
        self.base = base
        # A decode's HTTP base URL (as the router names it) -> its agent's name.
        self.decode_name = decode_name

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        f = self.figures
        names = list(self.base)
        base = list(self.base.values())
        errors = CounterMetricFamily(
            "tilert_decode_errors",
            "Refusals the router logged for each decode (429 after its retry, 504, ...)",
            labels=[*names, "decode", "kind", "code"],
        )
        for url, by_status in sorted(f.refusals.items()):
            for status, n in sorted(by_status.items()):
                errors.add_metric(
                    [*base, self.decode_name(url), _kind(status), str(status)], float(n)
                )
        yield errors
        if f.free is not None and f.busy is not None:
            pool = GaugeMetricFamily(
                "tilert_decode_pool_nodes",
                "Decode nodes in the router's pool, by state (/pool_status)",
                labels=[*names, "state"],
            )
            pool.add_metric([*base, "free"], float(f.free))
            pool.add_metric([*base, "busy"], float(f.busy))
            yield pool
        if f.tokenize is not None:
            yield from _tokenize_series(f.tokenize, names, base)


def _tokenize_series(t: RouterTokenize, names: list[str], base: list[str]) -> Iterable[Metric]:
    """``tilert_router_tokenize_*``: TileRT 0.1.6.post3's router-side tokenization."""
    on = GaugeMetricFamily(
        "tilert_router_tokenize_on",
        "1 when the router tokenizes chats itself (armed, self-check passed; /pool_status)",
        labels=names,
    )
    on.add_metric(base, 1.0 if t.on else 0.0)
    yield on
    for name, doc, value in (
        ("requests", "Chats the router tokenized itself (/pool_status)", t.requests),
        ("fallbacks", "Of those, chats that fell back to vLLM's chat path", t.fallback),
    ):
        family = CounterMetricFamily(f"tilert_router_tokenize_{name}", doc, labels=names)
        family.add_metric(base, float(value))
        yield family
