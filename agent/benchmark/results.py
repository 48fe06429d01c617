"""AIPerf's summary of one level (``profile_export_aiperf.json``) -> a ``LevelResult``'s fields.

AIPerf 0.13 writes each metric as ``{"unit": ..., "avg": ..., "p50": ...}``; a metric with no
sample (no failed request, say) is absent. Token counts are the server's (the runner asks for
``--use-server-token-count``). Only what summary.json names is read; the folder keeps the rest.

When every request failed AIPerf writes no summary and exits 1; its per-request records
(``profile_export.jsonl``) still say how many requests there were and why they failed, which is
what the verdict names ("0 output tokens in 4 requests: no responses with actual content").

Every field read is type-checked (the Structs below): an export of another shape (a new AIPerf
release, a custom client's own file) raises ``ResultsError`` naming the file and the field, which
fails that level and nothing else. Nothing else escapes these readers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE
from agent.errors import RuntimeFailure
from agent.problems import printable

# The longest request error kept (a message may hold a whole HTML page).
_ERROR_MAX = 200
# The largest export or record file read (AIPerf's are kilobytes to a few megabytes).
_FILE_MAX = 256 << 20


class ResultsError(RuntimeFailure):
    """The level's export is missing, unreadable or of another shape; the message says which
    file (and field)."""


class LevelRead(NamedTuple):
    """What one level's export says: the ``LevelResult`` fields (besides the verdict), the most
    frequent request error (escaped), and the requests it was asked to send (None: unknown)."""

    fields: dict[str, Any]
    request_error: str | None
    requested: int | None


class _Stat(msgspec.Struct, kw_only=True):
    """One metric: AIPerf's statistics of it (the rest, ``unit``, ``min``, ..., are not read)."""

    avg: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class _ErrorDetails(msgspec.Struct, kw_only=True):
    code: int | str | None = None
    type: str | None = None
    message: str | None = None


class _ErrorCount(msgspec.Struct, kw_only=True):
    error_details: _ErrorDetails | None = None
    count: int = 0


class _Phase(msgspec.Struct, kw_only=True):
    kind: str | None = None
    concurrency: int | None = None
    # The requests the phase was asked to send (None: bounded by a duration).
    requests: int | None = None


class _InputConfig(msgspec.Struct, kw_only=True):
    phases: list[_Phase] | None = None


class _Export(msgspec.Struct, kw_only=True):
    """The fields of ``profile_export_aiperf.json`` the summary names."""

    request_count: _Stat | None = None
    completed_request_count: _Stat | None = None
    error_request_count: _Stat | None = None
    total_isl: _Stat | None = None
    total_osl: _Stat | None = None
    benchmark_duration: _Stat | None = None
    request_throughput: _Stat | None = None
    output_token_throughput: _Stat | None = None
    output_token_throughput_per_user: _Stat | None = None
    time_to_first_token: _Stat | None = None
    inter_token_latency: _Stat | None = None
    request_latency: _Stat | None = None
    error_summary: list[_ErrorCount] | None = None
    input_config: _InputConfig | None = None


class _RecordError(msgspec.Struct, kw_only=True):
    message: str | None = None
    type: str | None = None


class _Value(msgspec.Struct, kw_only=True):
    value: float | None = None


class _RecordMetrics(msgspec.Struct, kw_only=True):
    output_sequence_length: _Value | None = None


class _Record(msgspec.Struct, kw_only=True):
    """One line of ``profile_export.jsonl``: a request's error, or its metrics."""

    error: _RecordError | str | None = None
    metrics: _RecordMetrics | None = None


def _read(path: Path) -> bytes:
    """The bytes of ``path`` (ResultsError when missing, unreadable or too large)."""
    try:
        with path.open("rb") as f:
            data = f.read(_FILE_MAX + 1)
    except FileNotFoundError:
        raise ResultsError(f"the client wrote no results ({path} is missing)") from None
    except OSError as exc:
        raise ResultsError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > _FILE_MAX:
        raise ResultsError(f"{path} is larger than {_FILE_MAX >> 20} MiB: not an AIPerf export")
    return data


def _decode(path: Path, data: bytes) -> _Export:
    try:
        return msgspec.json.decode(data, type=_Export)
    except msgspec.ValidationError as exc:
        raise ResultsError(f"{path} is not an AIPerf 0.13 export: {printable(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ResultsError(f"cannot read {path}: {printable(str(exc))}") from None


def _stat(path: Path, export: _Export, metric: str, stat: str = "avg") -> float | None:
    entry: _Stat | None = getattr(export, metric)
    value: float | None = getattr(entry, stat) if entry is not None else None
    if value is not None and not math.isfinite(value):
        raise ResultsError(f"{path}: {metric}.{stat} is {value}, not a finite number")
    return value


def _count(path: Path, export: _Export, metric: str) -> int:
    value = _stat(path, export, metric)
    if value is not None and value < 0:
        raise ResultsError(f"{path}: {metric}.avg is {value:g}, not a count")
    return round(value) if value is not None else 0


def first_error(export: _Export) -> str | None:
    """The most frequent request error AIPerf recorded (its message, escaped), or None."""
    summary = [e for e in export.error_summary or [] if e.count > 0]
    if not summary:
        return None
    top = max(summary, key=lambda e: e.count)
    details = top.error_details or _ErrorDetails()
    message = details.message or details.type or "unknown error"
    code = f" (HTTP {details.code})" if details.code not in (None, "") else ""
    return printable(f"{message[:_ERROR_MAX]}{code} x{top.count}")


def _phase(export: _Export) -> _Phase | None:
    """The profiling phase, as the export's own configuration says."""
    config = export.input_config
    phases = config.phases if config is not None else None
    return next((p for p in phases or [] if p.kind == "profiling"), None)


def read_level(folder: Path, gpus: int, concurrency: int | None = None) -> LevelRead:
    """What ``folder``'s AIPerf export says of its level (ResultsError naming the file, and the
    field, when it cannot say). ``concurrency``: the level's, else the export's own."""
    path = folder / EXPORT_FILE
    export = _decode(path, _read(path))
    ok = _count(path, export, "request_count")
    completed = _count(path, export, "completed_request_count")
    failed = _count(path, export, "error_request_count") or max(completed - ok, 0)
    output_tps = _stat(path, export, "output_token_throughput")
    phase = _phase(export)
    if concurrency is None:
        concurrency = phase.concurrency if phase is not None and phase.concurrency else 0
    fields: dict[str, Any] = {
        "concurrency": concurrency,
        "requests_ok": ok,
        "requests_failed": failed,
        "input_tokens": _count(path, export, "total_isl"),
        "output_tokens": _count(path, export, "total_osl"),
        "duration_s": _stat(path, export, "benchmark_duration"),
        "request_throughput": _stat(path, export, "request_throughput"),
        "output_throughput": output_tps,
        "output_throughput_per_user": _stat(path, export, "output_token_throughput_per_user"),
        "output_throughput_per_gpu": output_tps / gpus if output_tps is not None and gpus else None,
        "results": str(folder),
    }
    for name, metric in (
        ("ttft", "time_to_first_token"),
        ("itl", "inter_token_latency"),
        ("e2e", "request_latency"),
    ):
        for p in ("p50", "p90", "p99"):
            fields[f"{name}_{p}_ms"] = _stat(path, export, metric, p)
    requested = phase.requests if phase is not None else None
    return LevelRead(fields, first_error(export), requested)


def read_records(folder: Path) -> tuple[int, int, int, str | None]:
    """(requests ok, failed, output tokens, the most frequent error, escaped) from the
    per-request records; ResultsError when there are none or a record is of another shape."""
    path = folder / RECORDS_FILE
    try:
        data = _read(path)
    except ResultsError:
        raise ResultsError(
            f"the client wrote no results ({folder / EXPORT_FILE} is missing)"
        ) from None
    ok = failed = tokens = 0
    errors: dict[str, int] = {}
    lines = data.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = msgspec.json.decode(line, type=_Record)
        except msgspec.DecodeError as exc:
            if number == len(lines) and not data.endswith(b"\n"):
                break  # the last record, cut short when the client was stopped
            raise ResultsError(f"{path} line {number}: {printable(str(exc))}") from None
        if record.error:
            failed += 1
            error = record.error
            message = error if isinstance(error, str) else error.message or error.type or "?"
            errors[message] = errors.get(message, 0) + 1
            continue
        ok += 1
        osl = record.metrics.output_sequence_length if record.metrics is not None else None
        if osl is not None and osl.value is not None:
            if not math.isfinite(osl.value) or osl.value < 0:
                raise ResultsError(f"{path} line {number}: output_sequence_length {osl.value}")
            tokens += int(osl.value)
    top = max(errors, key=lambda m: errors[m]) if errors else None
    said = printable(f"{top[:_ERROR_MAX]} x{errors[top]}") if top is not None else None
    return ok, failed, tokens, said
