"""What a decode agent spends per request on its engine's REQSTAT line: the line as the log pump
hands it over (a block of its own), through the decode figures and the failure signature watch,
beside the pump's own handling of the same block without them."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from agent.node.decodestats import DecodeStats
from agent.node.enginewatch import EngineWatch
from agent.node.logpump import LogSink
from tests.bench.results import Figure

LINE = (
    b"decode_server.py:106 [INFO]: REQSTAT rid=7f3c2a0b9d1e seq=1234 completion=256 "
    b"wire_wait=12.5 convert=0.4 inject=1.1 decode=2450.0 finish_reason=length\n"
)


def _per_line_us(sink: LogSink, count: int) -> float:
    """Microseconds per line through ``sink``'s reading side (ring, watchers, queue)."""
    start = time.perf_counter()
    for _ in range(count):
        sink._accept(LINE)  # the pump's step for every block it reads
    return 1e6 * (time.perf_counter() - start) / count


def measure(_names: set[str], *, quick: bool) -> list[Figure]:
    """reqstat_us: per request, the whole reading side with the decode agent's watchers."""
    runs, count = (3, 2_000) if quick else (7, 20_000)
    with_watchers, without = [], []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-reqstat-") as tmp:
        for i in range(runs):
            plain = LogSink(Path(tmp) / f"plain{i}.log", max_bytes=1 << 30, backups=0)
            watched = LogSink(Path(tmp) / f"watched{i}.log", max_bytes=1 << 30, backups=0)
            stats, watch = DecodeStats(), EngineWatch("decode")
            watch.starting = False  # a serving engine: its startup is over
            watched.watchers += [stats.feed, watch.feed]
            without.append(_per_line_us(plain, count))
            with_watchers.append(_per_line_us(watched, count))
            assert sum(stats.requests.values()) == count
    note = f"{count} REQSTAT lines per run, one block each"
    return [
        Figure(
            "reqstat_us",
            with_watchers,
            reference="the log pump's reading side without the watchers",
            reference_runs=without,
            note=note,
        )
    ]
