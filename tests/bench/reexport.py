"""The prefill agent's ``/metrics`` for a 5,000-line vLLM page, every scrape a cache miss, beside
the raw page from a plain HTTP server; scrapes interleaved.

The page is the stand-in prefill's (``TILERT_MOCK_METRICS_FILE``), rewritten with fresh values
before each pair of scrapes, as vLLM's values move between two scrapes; the plain server serves
the same file. The agent's own series come with it, as Prometheus gets them.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.fakes import write_page
from tests.bench.procs import PY, REPO, agent_row, env, ready_job
from tests.bench.results import Figure

CACHE_S = 1.0  # the agent's cache of the vLLM page (UpstreamMetrics.cache_s)


def _scrape(client: httpx.Client, url: str) -> tuple[float, str]:
    start = time.perf_counter()
    response = client.get(url)
    took = time.perf_counter() - start
    response.raise_for_status()
    return took * 1000, response.text


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """reexport_p50_ms and reexport_ratio (median agent / median raw)."""
    scrapes = 10 if quick else 40
    with tempfile.TemporaryDirectory(prefix="tilert-bench-reexport-") as tmp:
        page = Path(tmp) / "vllm-metrics.txt"
        write_page(page, seed=0)
        server = subprocess.Popen(
            [PY, "-m", "tests.bench.fakes", "page-server", str(page)],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            raw_url = f"http://127.0.0.1:{int(server.stdout.readline())}/metrics"
            with ready_job(Path(tmp), f"roles.prefill.env.TILERT_MOCK_METRICS_FILE={page}") as (
                _,
                status,
                _,
            ):
                agent_url = agent_row(status, "prefill-0").metrics_url
                assert agent_url is not None
                raw, ours = [], []
                with httpx.Client(timeout=10) as agent_client, httpx.Client(timeout=10) as client:
                    _scrape(client, raw_url)
                    _, text = _scrape(agent_client, agent_url)  # the first page of its shape
                    last = time.monotonic()
                    for i in range(scrapes):
                        write_page(page, seed=i + 1)
                        raw.append(_scrape(client, raw_url)[0])
                        time.sleep(max(0.0, last + CACHE_S * 1.05 - time.monotonic()))
                        last = time.monotonic()
                        took, text = _scrape(agent_client, agent_url)
                        if "vllm:" not in text or "tilert_agent_upstream_up{" not in text:
                            raise RuntimeError(f"the agent's page has no re-export: {text[:500]}")
                        ours.append(took)
        finally:
            server.kill()
            server.wait()
    ratio = [o / statistics.median(raw) for o in ours]
    lines = len(page.read_text().splitlines()) if page.exists() else 0
    note = f"{lines or 'about 5,000'}-line page; raw page p50 {statistics.median(raw):.1f} ms"
    figures = []
    if "reexport_p50_ms" in names:
        figures.append(
            Figure("reexport_p50_ms", ours, "raw page, plain HTTP server", raw, "p50", note)
        )
    if "reexport_ratio" in names:
        figures.append(Figure("reexport_ratio", ratio, "raw page (ratio 1)", [1.0] * len(raw)))
    return figures
