"""``summary.json`` and its readable table (``summary.txt``, ``tilert-submit bench --show``).

One row per level: counts, throughput, and TTFT / ITL / end-to-end latency p50/p90/p99 in
milliseconds; ``--compare`` adds a first column naming each job by what differs between them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from agent.job.atomicfile import write_atomic
from agent.job.benchmark import BenchmarkFiles, BenchmarkSummary, LevelResult
from agent.problems import printable

COLUMNS: tuple[tuple[str, str], ...] = (
    ("CONC", "concurrency"),
    ("OK", "requests_ok"),
    ("FAIL", "requests_failed"),
    ("IN TOK", "input_tokens"),
    ("OUT TOK", "output_tokens"),
    ("REQ/S", "request_throughput"),
    ("OUT TOK/S", "output_throughput"),
    ("TOK/S/USER", "output_throughput_per_user"),
    ("TOK/S/GPU", "output_throughput_per_gpu"),
    ("TTFT p50", "ttft_p50_ms"),
    ("p90", "ttft_p90_ms"),
    ("p99", "ttft_p99_ms"),
    ("ITL p50", "itl_p50_ms"),
    ("p90", "itl_p90_ms"),
    ("p99", "itl_p99_ms"),
    ("E2E p50", "e2e_p50_ms"),
    ("p90", "e2e_p90_ms"),
    ("p99", "e2e_p99_ms"),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def level_rows(levels: Sequence[LevelResult], label: str | None = None) -> list[list[str]]:
    """Table rows of ``levels`` (with a first ``label`` column when given)."""
    rows = []
    for level in levels:
        cells = [_cell(getattr(level, field)) for _, field in COLUMNS]
        cells.append("passed" if level.passed else "FAILED")
        rows.append(([label] if label is not None else []) + cells)
    return rows


def render_rows(rows: list[list[str]], *, labelled: bool = False) -> str:
    """Aligned columns with a header; latencies are in ms."""
    header = (["JOB"] if labelled else []) + [name for name, _ in COLUMNS] + ["VERDICT"]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in table
    )


def render_summary(summary: BenchmarkSummary) -> str:
    """The verdict, what was measured, and one row per level."""
    # What clients said is escaped where it is read; once more here, for a summary.json written
    # by another version.
    error = f": {printable(summary.error)}" if summary.error else ""
    lines = [f"benchmark: {summary.state}{error}"]
    lines.append(printable(f"model: {summary.model} at {summary.router_url} ({summary.type})"))
    if summary.type == "aiperf":
        per_level = (
            f"{summary.num_requests} requests"
            if summary.num_requests is not None
            else f"{summary.duration_s:g}s"
            if summary.duration_s is not None
            else "10 requests per concurrent user"
        )
        rate = f", {summary.req_rate:g} req/s" if summary.req_rate is not None else ""
        lines.append(
            f"isl {summary.isl}, osl {summary.osl}, {per_level} per level{rate}, "
            f"max_error_rate {summary.max_error_rate:g}, GPUs {summary.gpus or '-'}"
        )
    if summary.levels:
        lines += ["", render_rows(level_rows(summary.levels)), "(latencies in ms)"]
    if summary.plots:
        lines += ["", "plots: " + ", ".join(summary.plots)]
    elif summary.plots_note:
        lines += ["", f"plots: {summary.plots_note}"]
    if summary.note:
        lines += ["", f"note: {printable(summary.note)}"]
    return "\n".join(lines)


def write_summary(files: BenchmarkFiles, summary: BenchmarkSummary) -> None:
    """Write summary.json and summary.txt (atomically: readers may be polling)."""
    files.root.mkdir(parents=True, exist_ok=True)
    body = msgspec.json.format(msgspec.json.encode(summary)) + b"\n"
    write_atomic(files.summary, body, mode=0o644)
    write_atomic(files.table, (render_summary(summary) + "\n").encode(), mode=0o644)
