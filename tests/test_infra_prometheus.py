"""A real Prometheus scrapes loopback exporters found through a file_sd targets file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from tests.conftest import require
from tests.infra.ports import free_port
from tests.infra.prometheus import (
    PrometheusServer,
    promtool_binary,
    promtool_check_metrics,
    write_targets,
)

pytestmark = pytest.mark.prometheus

Exporter = Callable[[str, float], str]


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    """``exporter(role, value)`` serves one gauge on a free loopback port; returns host:port."""
    servers = []

    def start(role: str, value: float) -> str:
        registry = CollectorRegistry()
        gauge = Gauge("tilert_test_value", "A test gauge.", ["role"], registry=registry)
        gauge.labels(role=role).set(value)
        port = free_port()
        server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))
        return f"127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_scrapes_file_sd_targets_and_follows_rewrites(
    tmp_path: Path,
    exporter: Exporter,
    prometheus_factory: Callable[[Path], PrometheusServer],
) -> None:
    # One test for both phases: each discovery change costs Prometheus about 5 s.
    targets = tmp_path / "prometheus" / "targets.json"
    first, second = exporter("prefill", 7), exporter("decode", 2)
    write_targets(targets, [{"targets": [first], "labels": {}}])
    prom = prometheus_factory(targets)
    result = prom.wait_for("tilert_test_value", timeout=30)
    assert len(result) == 1
    assert result[0]["metric"]["role"] == "prefill"
    assert result[0]["metric"]["instance"] == first
    assert result[0]["metric"]["job"] == "tilert"
    assert float(result[0]["value"][1]) == 7
    assert [t["health"] for t in prom.targets()] == ["up"]

    write_targets(targets, [{"targets": [first, second], "labels": {}}])
    result = prom.wait_for("tilert_test_value", lambda r: len(r) == 2, timeout=30)
    assert {s["metric"]["role"]: s["metric"]["instance"] for s in result} == {
        "prefill": first,
        "decode": second,
    }
    assert {float(s["value"][1]) for s in result} == {7, 2}


def test_unreachable_target_reports_its_error(
    tmp_path: Path, prometheus_factory: Callable[[Path], PrometheusServer]
) -> None:
    targets = tmp_path / "targets.json"
    dead = f"127.0.0.1:{free_port()}"
    write_targets(targets, [{"targets": [dead], "labels": {}}])
    prom = prometheus_factory(targets)
    result = prom.wait_for(f'up{{instance="{dead}"}}', timeout=30)
    assert float(result[0]["value"][1]) == 0
    (target,) = prom.targets()
    assert target["health"] == "down"
    assert target["lastError"]


def test_promtool_tells_clean_pages_from_broken_ones() -> None:
    require(promtool_binary() is not None, "promtool not installed")
    registry = CollectorRegistry()
    Gauge("tilert_test_value", "A test gauge.", registry=registry).set(1)
    code, output = promtool_check_metrics(generate_latest(registry).decode())
    assert code == 0, output
    code, output = promtool_check_metrics("# TYPE x gauge\nx{role=prefill} 1\n")
    assert code == 1, output
    assert "pars" in output
