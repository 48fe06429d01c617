"""agent.http.upstream: vLLM's /metrics fetched for the re-export from a real local HTTP server
(and an in-memory one that stalls): bounded in time and size, cached, failures reported."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from agent.http.reexport import relabel_page
from agent.http.upstream import UpstreamMetrics
from agent.web.asgi import App, Request, Response, StreamingResponse
from agent.web.server import bound_socket, serve
from tests.infra.ports import free_port
from tests.kit.metrics import (
    BAD_PAGES,
    OPENMETRICS_PAGE,
    PREFILL_LABELS,
    VLLM_CONTENT_TYPE,
    VLLM_PAGE,
)

# --- render() against a real local HTTP server ---------------------------------------------------


class Upstream:
    """A real HTTP server on 127.0.0.1 with a route per upstream behaviour."""

    def __init__(self) -> None:
        self.app = App()
        self.port = 0
        self.hits = 0
        self.page = VLLM_PAGE.read_bytes()
        self.sent = 0  # bytes the huge route produced
        self.accept: str | None = None
        route = self.app.route
        route("GET", "/metrics")(self.metrics)
        route("GET", "/slow")(self.slow)
        route("GET", "/openmetrics")(self.openmetrics)
        route("GET", "/broken")(self.broken)
        route("GET", "/trickle")(self.trickle)
        route("GET", "/huge")(self.huge)
        route("GET", "/huge-declared")(self.huge_declared)
        route("GET", "/gzip")(self.gzipped)
        for path in BAD_PAGES:
            route("GET", f"/{path.name}")(self.serving(path.read_bytes()))

    async def metrics(self, request: Request) -> Response:
        """vLLM's page, noting the Accept header it was asked with."""
        self.hits += 1
        self.accept = request.headers.get("accept")
        return Response(self.page, 200, VLLM_CONTENT_TYPE)

    async def slow(self, _request: Request) -> Response:
        """vLLM's page after 0.2 s."""
        self.hits += 1
        await trio.sleep(0.2)
        return Response(self.page, 200, VLLM_CONTENT_TYPE)

    async def openmetrics(self, _request: Request) -> Response:
        """The OpenMetrics twin of the page, as prometheus_client's own app serves it."""
        ctype = "application/openmetrics-text; version=1.0.0; charset=utf-8"
        return Response(OPENMETRICS_PAGE.read_bytes(), 200, ctype)

    async def broken(self, _request: Request) -> Response:
        """A 503."""
        return Response(b"engine dead\n", 503)

    async def trickle(self, _request: Request) -> StreamingResponse:
        """The page in ten chunks, 30 ms apart."""

        async def chunks() -> AsyncIterator[bytes]:
            step = len(self.page) // 10 + 1
            for i in range(0, len(self.page), step):
                yield self.page[i : i + step]
                await trio.sleep(0.03)

        return StreamingResponse(chunks(), 200, VLLM_CONTENT_TYPE)

    async def huge(self, _request: Request) -> StreamingResponse:
        """Up to 50 MB of samples, counted in ``sent`` as they go."""
        line = b'vllm:big{engine="0",pad="' + b"x" * 200 + b'"} 1\n'

        async def chunks() -> AsyncIterator[bytes]:
            chunk = line * 256  # ~55 KB
            while self.sent < 50 * 1024 * 1024:
                self.sent += len(chunk)
                yield chunk

        return StreamingResponse(chunks(), 200, VLLM_CONTENT_TYPE)

    async def huge_declared(self, _request: Request) -> Response:
        """A 2 MiB page whose Content-Length says so."""
        body = b"# x\n" * (512 * 1024)
        headers = {"content-length": str(len(body))}  # Response leaves it to hypercorn
        return Response(body, 200, VLLM_CONTENT_TYPE, headers)

    async def gzipped(self, _request: Request) -> Response:
        """The page gzipped although identity was asked for."""
        headers = {"content-encoding": "gzip"}
        return Response(gzip.compress(self.page), 200, VLLM_CONTENT_TYPE, headers)

    @staticmethod
    def serving(data: bytes) -> Callable[[Request], Awaitable[Response]]:
        """A route that answers ``data`` as classic text."""

        async def answer(_request: Request) -> Response:
            return Response(data, 200, VLLM_CONTENT_TYPE)

        return answer

    def url(self, path: str) -> str:
        """A URL on this server."""
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """The Upstream server, running for one test."""
    server = Upstream()
    sock = bound_socket("127.0.0.1", 0)
    server.port = sock.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, server.app, sock)
        # hypercorn wraps the same fd in its own socket object and closes it at shutdown; detach
        # ours so its garbage collection cannot close a later test's socket that reused the number
        sock.detach()
        yield server
        nursery.cancel_scope.cancel()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client like the agent's."""
    async with httpx.AsyncClient() as c:
        yield c


# An upstream that hangs or never finishes, in memory: the tests of the fetch deadline run on
# trio's MockClock (pytest-trio's ``autojump_clock``), so they wait out no real time.
STALLED = "http://stalled-upstream.invalid"


async def stalled_upstream(request: httpx.Request) -> httpx.Response:
    """No headers, a stalled body, or a body that never ends; /metrics is the real page."""
    headers = {"content-type": VLLM_CONTENT_TYPE}
    if request.url.path == "/hang-headers":
        await trio.sleep_forever()
    if request.url.path == "/hang-body":

        async def stalled() -> AsyncIterator[bytes]:
            yield VLLM_PAGE.read_bytes()[:1000]
            await trio.sleep_forever()

        return httpx.Response(200, headers=headers, content=stalled())
    if request.url.path == "/trickle-forever":

        async def trickle() -> AsyncIterator[bytes]:
            while True:  # each read is quick, so only an overall deadline stops this
                yield b"# still here\n"
                await trio.sleep(0.05)

        return httpx.Response(200, headers=headers, content=trickle())
    if request.url.path == "/metrics":

        async def whole() -> AsyncIterator[bytes]:  # streamed, as a server's body is
            yield VLLM_PAGE.read_bytes()

        return httpx.Response(200, headers=headers, content=whole())
    return httpx.Response(404)


@pytest.fixture
async def stalled_client() -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client whose upstream (at ``STALLED``) is ``stalled_upstream``, in memory."""
    async with httpx.AsyncClient(transport=httpx.MockTransport(stalled_upstream)) as c:
        yield c


async def render_timed(metrics: UpstreamMetrics, client: httpx.AsyncClient) -> tuple[str, float]:
    """render() and how long it took (it must never raise)."""
    start = trio.current_time()
    with trio.fail_after(30):
        text = await metrics.render(client)
    return text, trio.current_time() - start


async def test_render_real_page(upstream: Upstream, client: httpx.AsyncClient) -> None:
    """The live page is fetched as classic text and relabelled; status fields filled in."""
    metrics = UpstreamMetrics(upstream.url("/metrics"), PREFILL_LABELS)
    text = await metrics.render(client)
    assert text == relabel_page(VLLM_PAGE.read_text(), PREFILL_LABELS)
    assert upstream.accept == "text/plain; version=0.0.4"
    assert metrics.up
    assert metrics.last_error is None
    assert metrics.last_bytes == len(upstream.page)
    assert metrics.last_duration_s is not None
    assert metrics.last_duration_s >= 0


@pytest.mark.parametrize("path", BAD_PAGES, ids=[p.name for p in BAD_PAGES])
async def test_render_hostile_page(
    upstream: Upstream, client: httpx.AsyncClient, path: Path
) -> None:
    """A hostile page gives "" and up=False with a reason; nothing raises."""
    metrics = UpstreamMetrics(upstream.url(f"/{path.name}"), PREFILL_LABELS)
    text, _ = await render_timed(metrics, client)
    assert text == ""
    assert not metrics.up
    assert metrics.last_error
    assert upstream.url(f"/{path.name}") in metrics.last_error


async def test_render_openmetrics_and_http_errors(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """OpenMetrics, a 503, a gzip body we did not ask for: each refused with its reason."""
    for path, reason in (
        ("/openmetrics", "content-type"),
        ("/broken", "HTTP 503"),
        ("/gzip", "content-encoding"),
        ("/nowhere", "HTTP 404"),
    ):
        metrics = UpstreamMetrics(upstream.url(path), PREFILL_LABELS)
        assert await metrics.render(client) == ""
        assert not metrics.up
        assert metrics.last_error
        assert reason in metrics.last_error


@pytest.mark.parametrize("path", ["/hang-headers", "/hang-body", "/trickle-forever"])
async def test_hanging_or_trickling_upstream_bounded_by_timeout(
    autojump_clock: trio.testing.MockClock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    stalled_client: httpx.AsyncClient,
    path: str,
) -> None:
    """No headers, a stalled body, or a body that never ends: all cut at timeout_s overall."""
    metrics = UpstreamMetrics(STALLED + path, PREFILL_LABELS, timeout_s=0.5)
    text, took = await render_timed(metrics, stalled_client)
    assert text == ""
    assert not metrics.up
    assert metrics.last_error
    assert "within 0.5 s" in metrics.last_error
    assert 0.4 < took < 3.0  # a liveness bound, not a performance target


async def test_scrape_budget_shortens_the_timeout(
    autojump_clock: trio.testing.MockClock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    stalled_client: httpx.AsyncClient,
) -> None:
    """The scraper's deadline (budget_s) wins over a longer configured timeout."""
    metrics = UpstreamMetrics(STALLED + "/hang-headers", PREFILL_LABELS, timeout_s=30)
    with trio.fail_after(10):
        assert await metrics.render(stalled_client, budget_s=0.3) == ""
    assert metrics.last_error
    assert "within 0.3 s" in metrics.last_error


async def test_slow_but_finishing_upstream_is_fine(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A page that trickles in chunks but completes within timeout_s is accepted."""
    metrics = UpstreamMetrics(upstream.url("/trickle"), PREFILL_LABELS, timeout_s=10)
    assert await metrics.render(client) == relabel_page(VLLM_PAGE.read_text(), PREFILL_LABELS)
    assert metrics.up


async def test_huge_page_capped_while_streaming(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A 50 MB stream stops at max_bytes; the rest is never read."""
    limit = 1024 * 1024
    metrics = UpstreamMetrics(upstream.url("/huge"), PREFILL_LABELS, max_bytes=limit, timeout_s=20)
    text, _ = await render_timed(metrics, client)
    assert text == ""
    assert not metrics.up
    assert metrics.last_error
    assert "limit" in metrics.last_error
    assert limit < metrics.last_bytes < limit + 256 * 1024
    assert upstream.sent < 20 * 1024 * 1024


async def test_declared_huge_page_refused_before_reading(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A Content-Length over max_bytes is refused without reading the body."""
    metrics = UpstreamMetrics(upstream.url("/huge-declared"), PREFILL_LABELS, max_bytes=1024 * 1024)
    assert await metrics.render(client) == ""
    assert metrics.last_error
    assert "2097152 bytes" in metrics.last_error
    assert metrics.last_bytes == 0


async def test_connection_refused(client: httpx.AsyncClient) -> None:
    """Nothing listening: up=False, "cannot connect", quickly."""
    metrics = UpstreamMetrics(f"http://127.0.0.1:{free_port()}/metrics", PREFILL_LABELS)
    text, took = await render_timed(metrics, client)
    assert text == ""
    assert not metrics.up
    assert metrics.last_error
    assert "cannot connect" in metrics.last_error
    assert took < 3.0


async def test_cache_reused_within_cache_s(upstream: Upstream, client: httpx.AsyncClient) -> None:
    """Scrapes within cache_s (also concurrent ones) share one fetch; cache_s=0 always fetches."""
    metrics = UpstreamMetrics(upstream.url("/metrics"), PREFILL_LABELS, cache_s=30)
    first = await metrics.render(client)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(metrics.render, client)
    assert await metrics.render(client) == first
    assert upstream.hits == 1
    fresh = UpstreamMetrics(upstream.url("/metrics"), PREFILL_LABELS, cache_s=0)
    await fresh.render(client)
    await fresh.render(client)
    assert upstream.hits == 3


async def test_cache_age_counts_from_the_start_of_a_refresh(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Scrapes just over cache_s apart each fetch: counted from a refresh's end (0.2 s later),
    every second scrape would be served the previous page instead."""
    metrics = UpstreamMetrics(upstream.url("/slow"), PREFILL_LABELS, cache_s=1.0)
    start = trio.current_time()
    await metrics.render(client)
    await trio.sleep_until(start + 1.1)
    await metrics.render(client)
    assert upstream.hits == 2
    await metrics.render(client)  # well within 1 s of the second refresh's start
    assert upstream.hits == 2


async def test_cache_expires_and_upstream_recovers(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A broken page then a good one: up goes False then True again after cache_s."""
    upstream.page = b"not a metrics page\n"
    metrics = UpstreamMetrics(upstream.url("/metrics"), PREFILL_LABELS, cache_s=0.2)
    assert await metrics.render(client) == ""
    assert not metrics.up
    upstream.page = VLLM_PAGE.read_bytes()
    assert await metrics.render(client) == ""  # still the cached failure
    await trio.sleep(0.3)
    assert await metrics.render(client) != ""
    assert metrics.up
    assert metrics.last_error is None
    assert upstream.hits == 2


async def test_cancellation_propagates(
    autojump_clock: trio.testing.MockClock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
    stalled_client: httpx.AsyncClient,
) -> None:
    """render() swallows upstream failures but not the caller's own cancellation."""
    metrics = UpstreamMetrics(STALLED + "/hang-headers", PREFILL_LABELS, timeout_s=30)
    with trio.move_on_after(0.3) as scope:
        await metrics.render(stalled_client)
    assert scope.cancelled_caught
    metrics.url = STALLED + "/metrics"
    assert await metrics.render(stalled_client) != ""  # the lock was released
