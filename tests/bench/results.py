"""One benchmark figure (its runs, its reference, its target), the table and bench-results.json."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# The figures of issue 12, in its order: (unit, target, better, what).
FIGURES: dict[str, tuple[str, float, Literal["lower", "higher"], str]] = {
    "gate_ms_p50": ("ms", 20, "lower", "last worker's own healthy -> router process running, p50"),
    "gate_ms_p95": ("ms", 50, "lower", "the same, p95"),
    "srtctl_gate_ms_p50": ("ms", math.inf, "lower", "the same with srtctl's 5 s polling, p50"),
    "head_idle_cpu_pct": ("%", 1, "lower", "a ready job's head agent, scraped every 5 s"),
    "agent_idle_cpu_pct": ("%", 1, "lower", "a ready job's decode agent, scraped every 5 s"),
    "agent_rss_mb": ("MB", 50, "lower", "one agent supervising one engine"),
    "reexport_p50_ms": ("ms", 15, "lower", "prefill agent /metrics, 5,000-line vLLM page, p50"),
    "reexport_ratio": ("x", 3, "lower", "... against the raw page from a plain HTTP server"),
    "log_pump_ratio_64k": ("x", 0.5, "higher", "64 KiB writes through the agent / to a file"),
    "log_pump_drop_pct": ("%", 0, "lower", "lines the agent dropped (the worst run)"),
    "reqstat_us": ("us", 100, "lower", "a decode agent's cost per request: its REQSTAT line"),
    "head_follow_1024_ms": ("ms", 1000, "lower", "1,024 peers' records appear -> all followed"),
    "head_follow_cpu_1024_pct": ("%", 5, "lower", "the head following 1,024 peers, gate closed"),
    "cli_help_ms": ("ms", 100, "lower", "tilert-submit --help"),
    "cli_status_ms": ("ms", 100, "lower", "tilert-submit status J"),
    "dry_run_64_decode_ms": ("ms", 150, "lower", "tilert-submit --dry-run, 1 prefill + 64 decode"),
    "local_ready_s_p50": ("s", 1.5, "lower", "--local --mock start -> ready, p50"),
    "heal_s": ("s", 0.5, "lower", "decode SIGKILL -> serving again, minus the stand-in's start"),
    "handover_gap_s": ("s", math.inf, "lower", "router hand-over: refused connections, longest"),
    "handover_failed": ("", 0, "lower", "router hand-over: requests failed otherwise (worst run)"),
    # Issue 28's front door, measured beside the router in the same job.
    "front_added_ms_p50": ("ms", 2, "lower", "the front's added latency per streamed chat, p50"),
    "front_added_ms_p95": ("ms", math.inf, "lower", "the same, p95"),
    "front_stream_ratio": ("x", 0.95, "higher", "streamed bytes/s through the front / direct"),
    # Issue 38: the front beside the floors (a bare pass-through, nginx, HAProxy).
    "front_cpu_us_per_event": ("us", 60, "lower", "the front's CPU per streamed event"),
    "front_cpu_s_per_1k": ("s", math.inf, "lower", "the front's CPU per 1,000 streamed chats"),
    "front_ttfb_p99_x_nginx": ("x", 1.5, "lower", "p99 time to first byte, 32 clients / nginx's"),
    # Issue 38: the service front before its one cell (the same job), service front + front door.
    "service_added_ms_p50": ("ms", math.inf, "lower", "service front + cell added per chat, p50"),
    "service_cpu_us_per_event": (
        "us",
        math.inf,
        "lower",
        "the service front's + the cell's front door's CPU per streamed event",
    ),
    "front_events_per_s": (
        "/s",
        20000,
        "higher",
        "events per CPU-second of one front process, saturated",
    ),
}

Statistic = Literal["median", "mean", "p50", "p95", "max"]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated between the nearest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float]) -> dict[str, float | int]:
    """min / median / max (and how many) of ``values``."""
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


@dataclass
class Figure:
    """One figure of the table: its runs, and its reference measured beside it."""

    name: str
    runs: list[float]
    reference: str  # what the reference is
    reference_runs: list[float] = field(default_factory=list)
    statistic: Statistic = "median"
    note: str = ""

    @property
    def unit(self) -> str:
        """The figure's unit (FIGURES)."""
        return FIGURES[self.name][0]

    @property
    def value(self) -> float:
        """The figure: the statistic its name asks for over its runs."""
        if not self.runs:
            return math.nan
        if self.statistic == "p95":
            return percentile(self.runs, 0.95)
        if self.statistic == "max":
            return max(self.runs)
        if self.statistic == "mean":
            return statistics.fmean(self.runs)
        return statistics.median(self.runs)

    @property
    def target(self) -> str:
        """``<= 20`` or ``>= 0.5`` (no target: ``reference only``)."""
        _, limit, better, _ = FIGURES[self.name]
        if math.isinf(limit):
            return "reference only"
        return f"{'<=' if better == 'lower' else '>='} {limit:g}"

    @property
    def passed(self) -> bool | None:
        """Whether the figure meets its target (None when it has none or was not measured)."""
        _, limit, better, _ = FIGURES[self.name]
        value = self.value
        if math.isinf(limit) or math.isnan(value):
            return None
        return value <= limit if better == "lower" else value >= limit

    def as_json(self) -> dict[str, object]:
        """This figure in bench-results.json."""
        return {
            "value": self.value,
            "unit": self.unit,
            "target": self.target,
            "pass": self.passed,
            "what": FIGURES[self.name][3],
            "statistic": self.statistic,
            "runs": {**spread(self.runs), "values": self.runs},
            "reference": {"what": self.reference, **spread(self.reference_runs)},
            "note": self.note,
        }


def _number(value: float) -> str:
    if math.isnan(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def table(figures: list[Figure]) -> str:
    """The printed table: figure, target, verdict, runs, and the reference beside them."""
    header = ["figure", "value", "target", "ok", "runs min / median / max (n)", "reference"]
    rows = [header]
    for f in figures:
        runs = spread(f.runs)
        ref = spread(f.reference_runs)
        verdict = {True: "PASS", False: "FAIL", None: "-"}[f.passed]
        run_text = (
            f"{_number(runs['min'])} / {_number(runs['median'])} / {_number(runs['max'])} "
            f"({runs['count']})"
            if runs["count"]
            else "-"
        )
        ref_text = f"{_number(ref['median'])} {f.unit}: {f.reference}" if ref["count"] else ""
        rows.append([f.name, f"{_number(f.value)} {f.unit}", f.target, verdict, run_text, ref_text])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    notes = [f"  {f.name}: {f.note}" for f in figures if f.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    return {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write(path: Path, figures: list[Figure], options: dict[str, object]) -> None:
    """bench-results.json: the machine, the options, and every figure by its name."""
    data = {
        "machine": machine(),
        "options": options,
        "results": {f.name: f.as_json() for f in figures},
    }
    path.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")


def _finite(value: object) -> object:
    """``value`` with NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
