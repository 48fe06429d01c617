"""AIPerf's summary of one level (``profile_export_aiperf.json``) -> a ``LevelResult``'s fields.

AIPerf 0.13 writes each metric as ``{"unit": ..., "avg": ..., "p50": ...}``; a metric with no
sample (no failed request, say) is absent. Token counts are the server's (the runner asks for
``--use-server-token-count``). Only what summary.json names is read; the folder keeps the rest.

When every request failed AIPerf writes no summary and exits 1; its per-request records
(``profile_export.jsonl``) still say how many requests there were and why they failed, which is
what the verdict names ("0 output tokens in 4 requests: no responses with actual content").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE
from agent.errors import RuntimeFailure


class ResultsError(RuntimeFailure):
    """The level's export is missing or unreadable; the message says which file."""


def _stat(data: dict[str, Any], metric: str, stat: str = "avg") -> float | None:
    entry = data.get(metric)
    if not isinstance(entry, dict):
        return None
    value = entry.get(stat)
    return float(value) if isinstance(value, int | float) else None


def _count(data: dict[str, Any], metric: str) -> int:
    value = _stat(data, metric)
    return round(value) if value is not None else 0


def first_error(data: dict[str, Any]) -> str | None:
    """The most frequent request error AIPerf recorded (its message), or None."""
    summary = data.get("error_summary")
    if not isinstance(summary, list) or not summary:
        return None
    top = max(summary, key=lambda e: e.get("count", 0) if isinstance(e, dict) else 0)
    if not isinstance(top, dict):
        return None
    details = top.get("error_details") or {}
    message = details.get("message") or details.get("type") or "unknown error"
    code = details.get("code")
    return f"{message}{f' (HTTP {code})' if code else ''} x{top.get('count', '?')}"


def _concurrency(data: dict[str, Any]) -> int | None:
    """The profiling phase's concurrency, as the export's own configuration says."""
    config = data.get("input_config")
    phases = config.get("phases") if isinstance(config, dict) else None
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict) and phase.get("kind") == "profiling":
            value = phase.get("concurrency")
            return value if isinstance(value, int) else None
    return None


def read_level(
    folder: Path, gpus: int, concurrency: int | None = None
) -> tuple[dict[str, Any], str | None]:
    """The ``LevelResult`` fields (besides the verdict) from ``folder``'s AIPerf export, and the
    most frequent request error it recorded. ``concurrency``: the level's, else the export's."""
    path = folder / EXPORT_FILE
    try:
        data = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise ResultsError(f"the client wrote no results ({path} is missing)") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path} is not an AIPerf summary")
    ok = _count(data, "request_count")
    completed = _count(data, "completed_request_count")
    failed = _count(data, "error_request_count") or max(completed - ok, 0)
    output_tps = _stat(data, "output_token_throughput")
    fields: dict[str, Any] = {
        "concurrency": concurrency if concurrency is not None else (_concurrency(data) or 0),
        "requests_ok": ok,
        "requests_failed": failed,
        "input_tokens": _count(data, "total_isl"),
        "output_tokens": _count(data, "total_osl"),
        "duration_s": _stat(data, "benchmark_duration"),
        "request_throughput": _stat(data, "request_throughput"),
        "output_throughput": output_tps,
        "output_throughput_per_user": _stat(data, "output_token_throughput_per_user"),
        "output_throughput_per_gpu": output_tps / gpus if output_tps is not None and gpus else None,
        "results": str(folder),
    }
    for name, metric in (
        ("ttft", "time_to_first_token"),
        ("itl", "inter_token_latency"),
        ("e2e", "request_latency"),
    ):
        for p in ("p50", "p90", "p99"):
            fields[f"{name}_{p}_ms"] = _stat(data, metric, p)
    return fields, first_error(data)


_ERROR_MAX = 200


def read_records(folder: Path) -> tuple[int, int, int, str | None]:
    """(requests ok, failed, output tokens, the most frequent error) from the per-request
    records; ResultsError when there are none."""
    path = folder / RECORDS_FILE
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        raise ResultsError(
            f"the client wrote no results ({folder / EXPORT_FILE} is missing)"
        ) from None
    ok = failed = tokens = 0
    errors: dict[str, int] = {}
    for line in lines:
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        if not isinstance(record, dict):
            continue
        error = record.get("error")
        if error:
            failed += 1
            message = str(error.get("message") if isinstance(error, dict) else error)
            errors[message] = errors.get(message, 0) + 1
            continue
        ok += 1
        metrics = record.get("metrics") or {}
        osl = metrics.get("output_sequence_length") if isinstance(metrics, dict) else None
        if isinstance(osl, dict) and isinstance(osl.get("value"), int | float):
            tokens += int(osl["value"])
    top = max(errors, key=lambda m: errors[m]) if errors else None
    said = f"{top[:_ERROR_MAX]} x{errors[top]}" if top is not None else None
    return ok, failed, tokens, said
