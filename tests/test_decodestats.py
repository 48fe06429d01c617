"""The decode's figures from TileRT's own lines (``agent.node.decodestats``) and their page.

REQSTAT and refusal lines exactly as TileRT 0.1.6.post3 writes them, the router's refusal lines
and its ``/pool_status``, the ``/decode_status`` samples, and the page through promtool. The same
figures from a running job: tests/test_decode_metrics.py.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from agent.http.metrics import AgentMetrics
from agent.node.decodestats import POOL_KEEP_S, DecodeStats, PoolFigures, poll_decode_status
from tests.infra.prometheus import promtool_binary, promtool_check_metrics

# The exact lines of TileRT 0.1.6.post3 (decode_server.py), and of its router (pd_router.py).
REQSTAT_LINES = (
    b"decode_server.py:106 [INFO]: REQSTAT rid=abc-1 seq=1234 completion=5 wire_wait=12.5 "
    b"convert=0.4 inject=1.1 decode=40.0 finish_reason=stop\n"
    b"decode_server.py:106 [INFO]: REQSTAT rid=abc-2 seq=7 completion=1 wire_wait=0.1 "
    b"convert=0.0 inject=0.0 decode=0.0 finish_reason=length mtp_accept_mean=0.8 "
    b"mtp_verify_calls=3\n"
)
REFUSAL_LINES = (
    b"decode_server.py:140 [INFO]: cancelled during KV transfer for abc-3\n"
    b"decode_server.py:124 [INFO]: sampling rejected for abc-4: min_p is not supported by the "
    b"TileRT decode stage (capability_unavailable)\n"
    b"decode_server.py:124 [INFO]: sampling rejected for abc-5: top_p must be in (0, 1] "
    b"(invalid_parameter)\n"
    b"decode_server.py:190 [ERROR]: decode failed for abc-6\n"
    b"decode_server.py:118 [INFO]: logprobs requested but unsupported by MlaNsaEngineAdapter "
    b"(rid=abc-7)\n"
)
ROUTER_LINES = (
    b"pd_router.py:38 [WARNING]: decode node http://10.0.0.2:5557 still busy for r1 after 2 "
    b"attempts\n"
    b"pd_router.py:40 [ERROR]: decode node http://10.0.0.3:5557 returned 504 for r2: "
    b"{'error': 'kv_transfer_timeout', 'rid': 'r2'}\n"
)


def test_reqstat_and_refusals_counted_from_tilert_lines() -> None:
    stats = DecodeStats()
    # Fed in two pieces, as the pump hands over blocks of whole lines.
    stats.feed(REQSTAT_LINES + b"decode_server.py:64 [INFO]: cancel requested for x\n")
    stats.feed(REFUSAL_LINES)
    assert stats.requests == {"stop": 1, "length": 1, "error": 5}
    assert (stats.prompt_tokens, stats.output_tokens) == (1241, 6)
    assert stats.errors == {499: 1, 501: 2, 400: 1, 500: 1}
    assert stats.stages["transfer_wait"].count == 2
    assert stats.stages["transfer_wait"].total == pytest.approx(0.0126)
    # Only the request that made tokens of its own has a time per output token: 40 ms / 4.
    assert stats.tpot.count == 1
    assert stats.tpot.total == pytest.approx(0.010)


def test_busy_time_is_sampled_from_decode_status() -> None:
    stats = DecodeStats()
    stats.sample(True, 1.0)  # the first answer: nothing before it
    stats.sample(False, 1.0)  # busy for the second before it
    stats.sample(None, 1.0)  # idle for the one before; no answer now
    assert stats.busy_seconds == 1.0
    assert stats.status_polls == {"busy": 1, "idle": 1, "failed": 1}


async def test_the_busy_time_of_the_poll_is_trio_time(autojump_clock: trio.abc.Clock) -> None:  # noqa: ARG001
    # A decode busy at every answer: ten polls 1 s apart are 9 s busy (the first has nothing
    # before it). Measured with time.monotonic() between trio's sleeps, this was ~0 s.
    stats = DecodeStats()

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "busy", "current_rid": "r1"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with trio.move_on_after(10.5):
            await poll_decode_status(
                stats, client, lambda: "http://decode/decode_status", lambda: True, interval_s=1.0
            )
    assert stats.status_polls["busy"] == 10
    assert stats.busy_seconds == pytest.approx(9.0)


def test_router_refusals_and_pool() -> None:
    pool = PoolFigures()

    def figures() -> tuple[int | None, int | None]:
        return pool.free, pool.busy

    pool.feed(ROUTER_LINES)
    assert pool.refusals == {"http://10.0.0.2:5557": {429: 1}, "http://10.0.0.3:5557": {504: 1}}
    pool.pool(
        b'{"nodes": [{"host": "10.0.0.2", "busy": true}, {"host": "10.0.0.3", "busy": false}]}',
        now=10.0,
    )
    assert figures() == (1, 1)
    pool.pool(None, now=10.0 + POOL_KEEP_S / 2)  # one poll timed out: the last answer stands
    assert figures() == (1, 1)
    pool.pool(b"<html>", now=10.0 + POOL_KEEP_S)
    assert figures() == (None, None)
    pool.pool(b'{"nodes": []}', now=20.0)
    assert figures() == (0, 0)
    pool.forget()  # the router stopped
    assert figures() == (None, None)


# TileRT 0.1.6.post3's /pool_status with router-side tokenization armed (pd_router.py).
TOKENIZE_STATUS = (
    b'{"nodes": [{"host": "10.0.0.2", "busy": false}], "router_tokenize": {"on": true, '
    b'"requests": 40, "fallback": 3, "before_self_check": 2, "cache": {"entries": 5, '
    b'"bytes": 100, "max_bytes": 1000, "evicted": 0, "hit_rate_chars": 0.5}}}'
)


def test_router_tokenize_block_as_series() -> None:
    """``router_tokenize`` of /pool_status: on, requests, fallbacks on the head's page; gone
    when the router's answer has none (not armed) or no router runs."""
    pool = PoolFigures()
    pool.pool(TOKENIZE_STATUS, now=1.0)
    page = AgentMetrics(
        role="prefill",
        node="n1",
        slurm_job_id="1",
        supervisors=dict,
        pool=(pool, lambda _url: "decode-0"),
    ).render()
    assert 'tilert_router_tokenize_on{node="n1",role="prefill",slurm_job_id="1"} 1.0' in page
    assert "tilert_router_tokenize_requests_total{" in page
    assert '"} 40.0' in page.split("tilert_router_tokenize_requests_total{", 1)[1][:80]
    assert '"} 3.0' in page.split("tilert_router_tokenize_fallbacks_total{", 1)[1][:80]
    pool.pool(b'{"nodes": []}', now=2.0)
    assert pool.tokenize is None
    pool.pool(TOKENIZE_STATUS, now=3.0)
    pool.forget()
    assert pool.tokenize is None


def test_page_passes_promtool() -> None:
    from tests.conftest import require

    require(promtool_binary() is not None, "promtool not installed")
    stats, pool = DecodeStats(), PoolFigures()
    stats.feed(REQSTAT_LINES + REFUSAL_LINES)
    stats.sample(True, 1.0)
    pool.feed(ROUTER_LINES)
    pool.pool(TOKENIZE_STATUS, now=1.0)
    for kw in ({"decode": stats}, {"pool": (pool, lambda _url: "decode-0")}):
        page = AgentMetrics(
            role="decode", node="n1", slurm_job_id="1", supervisors=dict, **kw
        ).render()
        assert "tilert_decode_errors_total" in page
        code, output = promtool_check_metrics(page)
        assert code == 0, output
