"""The Grafana dashboard's service row (docs/grafana-dashboard.json, docs/metrics.md) against a
real service: ``tilert-submit serve --local --mock`` with streaming load, scraped by a real
Prometheus through ``S/targets.json`` (the service front and every cell's agents): every query of
the row returns data."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.infra.ports import free_port
from tests.infra.prometheus import PrometheusServer
from tests.kit.service import ServeProc, cluster_file, service_sets
from tests.test_decode_metrics import dashboard_queries

READY_S = 90.0
HELLO = {"role": "user", "content": "hi"}


def _chat(url: str) -> int:
    """One streamed chat through the service front; its status (the load only feeds the series:
    what the front answers is tests/test_service_local.py's to check)."""
    body = {"model": "demo-model", "stream": True, "messages": [HELLO], "max_tokens": 8}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
        for _ in reply.iter_bytes():
            pass
        return reply.status_code


def test_every_service_row_query_returns_data(
    tmp_path: Path, prometheus_factory: Callable[[Path], PrometheusServer]
) -> None:
    port = free_port()
    sets = service_sets(port, "slurm.time_limit='10'")
    with ServeProc(tmp_path / "S", ["--cluster", str(cluster_file(tmp_path)), *sets]) as serve:
        status = serve.wait("serving", lambda s: s.get("state") == "serving", READY_S)
        name, url = status["name"], status["front_url"]
        prom = prometheus_factory(tmp_path / "S" / "targets.json")
        prom.wait_for(f'up{{service="{name}"}} == 1', timeout=40)
        stop = threading.Event()

        answers: list[int] = []

        def load() -> None:
            while not stop.is_set():
                answers.append(_chat(url))

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        empty = []
        queries = dashboard_queries("service", name)
        assert len(queries) >= 8, queries
        try:
            for title, expr in queries:
                try:
                    prom.wait_for(expr, timeout=40)
                except TimeoutError:
                    empty.append((title, expr))
        finally:
            stop.set()
            thread.join(60)
        assert not empty, f"service row queries that returned nothing: {empty}"
        assert 200 in answers, answers
        assert serve.stop(120) == 0, serve.output()
