"""The ``tilert_decode_*`` series and the Grafana dashboard (docs/metrics.md), end to end: one
``--local --mock`` job (the real router) under load: every decode agent's counts against the
requests sent, promtool on every page, and every dashboard panel's query against a real Prometheus
scraping the job. The line formats alone: tests/test_decodestats.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import kit
from tests.infra.prometheus import PrometheusServer, promtool_binary, promtool_check_metrics
from tests.kit.metrics import sample_map

DASHBOARD = kit.REPO / "docs" / "grafana-dashboard.json"
MODEL = "demo-model"
READY_S = 120.0  # a bound only: a router start takes 20 s on a loaded 2-core machine
STOP_S = 30.0
# ---- end to end: a job under load --------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_job(
    tmp_path_factory: pytest.TempPathFactory, router_python: Path
) -> Iterator[kit.Shared[kit.LocalJob]]:
    """One job (the real router, a decode token delay so busy time is not zero) for the module."""

    @contextlib.contextmanager
    def start() -> Iterator[kit.LocalJob]:
        sets, _ = kit.isolated_sets(
            router_python, "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.005"
        )
        root = tmp_path_factory.mktemp("decodejob")
        with kit.LocalJob(root / "J", sets, env=kit.clean_env()) as running:
            yield running
            running.stop(STOP_S)

    def prepare(running: kit.LocalJob) -> None:
        running.wait_state("ready", timeout=READY_S)

    with kit.Shared(start, prepare=prepare, ended=kit.LocalJob.ended) as shared:
        yield shared


@pytest.fixture
def job(
    shared_job: kit.Shared[kit.LocalJob], request: pytest.FixtureRequest
) -> Iterator[kit.LocalJob]:
    """The shared job, ready."""
    yield from shared_job.borrow(request)


def _pages(job: kit.LocalJob) -> dict[str, dict[tuple[str, Any], float]]:
    """Every agent's /metrics, parsed: ``{agent: {(name, labels): value}}``."""
    out = {}
    for agent in job.status()["agents"]:
        page = kit.get(agent["metrics_url"]).text
        out[agent["name"]] = sample_map(page)
    return out


def _total(page: dict[tuple[str, Any], float], name: str, **want: str) -> float:
    return sum(
        v
        for (n, labels), v in page.items()
        if n == name and all(dict(labels).get(k) == x for k, x in want.items())
    )


def _served(page: dict[tuple[str, Any], float]) -> float:
    """Requests a decode finished (every outcome but a refusal)."""
    return sum(
        v
        for (n, labels), v in page.items()
        if n == "tilert_decode_requests_total" and dict(labels).get("outcome") != "error"
    )


def _chat(router_url: str, i: int) -> int:
    """One non-streamed chat through the router; the completion tokens it reports."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Hello {i}"}],
        "max_tokens": 12,
    }
    response = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["completion_tokens"])


def test_decode_series_count_the_requests_sent(job: kit.LocalJob) -> None:
    """Each decode agent's REQSTAT counts: summed over the decodes, what the client sent and got."""
    router = job.status()["router_url"]
    decodes = [a["name"] for a in job.status()["agents"] if a["role"] == "decode"]
    before = _pages(job)
    sent = 12
    with ThreadPoolExecutor(2) as pool:  # two decodes: two at a time, none refused
        tokens = sum(pool.map(lambda i: _chat(router, i), range(sent)))

    def counted() -> dict[str, dict[tuple[str, Any], float]] | None:
        now = _pages(job)
        done = sum(_served(now[d]) - _served(before[d]) for d in decodes)
        return now if done >= sent else None

    after = kit.wait_for("the decodes' REQSTAT counts", counted, 20)
    assert after is not None

    def delta(name: str, d: str, **labels: str) -> float:
        return _total(after[d], name, **labels) - _total(before[d], name, **labels)

    assert sum(_served(after[d]) - _served(before[d]) for d in decodes) == sent
    assert sum(delta("tilert_decode_output_tokens_total", d) for d in decodes) == tokens
    for stage in ("transfer_wait", "conversion", "injection", "generation"):
        family = f"tilert_decode_{stage}_seconds_count"
        assert sum(delta(family, d) for d in decodes) == sent, stage
    assert (
        sum(delta("tilert_decode_time_per_output_token_seconds_count", d) for d in decodes) == sent
    )
    for d in decodes:
        assert _served(after[d]) - _served(before[d]) > 0, f"{d} served nothing"
        assert delta("tilert_decode_errors_total", d) == 0
        assert _total(after[d], "tilert_decode_status_polls_total", status="idle") > 0
    head = after["prefill-0"]
    nodes = [_total(head, "tilert_decode_pool_nodes", state=s) for s in ("free", "busy")]
    assert sum(nodes) == len(decodes), nodes
    # TileRT 0.1.6.post3's router tokenizes chats itself (its /pool_status router_tokenize).
    assert "tilert_router_tokenize_on" in {name for name, _ in head}, sorted(head)[:20]


def test_promtool_accepts_decode_and_head_pages(job: kit.LocalJob) -> None:
    from tests.conftest import require

    require(promtool_binary() is not None, "promtool not installed")
    for agent in job.status()["agents"]:
        page = kit.get(agent["metrics_url"]).text
        code, output = promtool_check_metrics(page)
        lint = [
            line
            for line in output.splitlines()
            if line.strip()
            and "should not contain ':'" not in line
            and "non-counter metrics should not have" not in line
        ]
        assert code in (0, 3), (agent["name"], output)
        assert not lint, (agent["name"], output)


def dashboard_queries(
    variable: str = "slurm_job_id", value: str = "local"
) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every panel target that selects by ``$variable`` (a job's
    panels, or the service row's: ``service``), Grafana's variables filled in."""
    model = json.loads(DASHBOARD.read_text())
    out = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            if f"${variable}" not in target["expr"]:
                continue
            expr = target["expr"].replace(f"${variable}", value)
            out.append((panel["title"], expr.replace("$__rate_interval", "20s")))
    return out


def test_dashboard_model_is_grafanas() -> None:
    """The JSON model Grafana imports: a title, a uid, variables, panels with ids and targets."""
    model = json.loads(DASHBOARD.read_text())
    assert model["uid"]
    assert model["title"]
    assert model["schemaVersion"] >= 36
    names = {v["name"] for v in model["templating"]["list"]}
    assert names == {"datasource", "slurm_job_id", "service"}
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    for panel in model["panels"]:
        assert panel["description"], panel["title"]
        if panel["type"] == "row":  # a heading (the service's), no query of its own
            assert not panel.get("targets"), panel["title"]
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
    # Every query selects one job or one service: none is left out of the tests' queries.
    every = sum(len(p.get("targets", [])) for p in model["panels"])
    assert every == len(dashboard_queries()) + len(dashboard_queries("service"))


def test_every_dashboard_query_returns_data(
    job: kit.LocalJob, prometheus_factory: Callable[[Path], PrometheusServer]
) -> None:
    """Under load, each panel's query has data in a real Prometheus scraping the job."""
    prom = prometheus_factory(job.job / "prometheus" / "targets.json")
    prom.wait_for("up", lambda r: len(r) == 3 and all(x["value"][1] == "1" for x in r), 40)
    # Through the front door, as clients send it: its panels have data then too.
    router = job.status()["front_url"]
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            _chat(router, i)
            i += 1

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    empty = []
    try:
        for title, expr in dashboard_queries():
            try:
                prom.wait_for(expr, timeout=40)
            except TimeoutError:
                empty.append((title, expr))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not empty, f"dashboard queries that returned nothing: {empty}"
