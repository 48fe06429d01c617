"""The agent's one HTTP client: health probes, the head's canaries, the vLLM scrape (the head's
long polls of its peers go over bare connections of their own, ``agent.http.longpoll``).

An ``httpx.AsyncClient`` loads an SSL context from certifi when it is built (20-35 ms of CPU on a
2-core node), although every URL the agent fetches is plain http. One client per peer made the
head follow 1,024 peers only after 25 s, with the event loop stalled meanwhile; one built for the
router's probes sat between the last worker's healthy answer and the router's start. So the node
agent builds ONE client, with one SSL context, in a worker thread before it serves anything, and
hands it to every part; each request passes its own timeout.

Behind it, one connection pool per origin (``OriginPools``): httpcore's pool looks at every one
of its connections on each request and each response (and, for each idle one, counts the idle
ones again), so a single pool holding the head's 1,024 long polls took minutes to follow them.
"""

from __future__ import annotations

import ssl

import httpx
import trio

# Per origin: the canaries hold one connection to the router per decode, all at once.
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)
# For a request that names no timeout of its own; every caller in the agent names one.
DEFAULT_TIMEOUT_S = 5.0


class OriginPools(httpx.AsyncBaseTransport):
    """A connection pool per (scheme, host, port), all sharing one SSL context."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        self.ssl_context = ssl_context
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` through its origin's pool (made on first use)."""
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx.AsyncHTTPTransport(
                verify=self.ssl_context, limits=LIMITS
            )
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        """Close every pool."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


def build_client() -> httpx.AsyncClient:
    """A client for the whole agent (blocking: builds an SSL context; see ``open_client``)."""
    transport = OriginPools(httpx.create_ssl_context())
    return httpx.AsyncClient(timeout=DEFAULT_TIMEOUT_S, transport=transport)


async def open_client() -> httpx.AsyncClient:
    """``build_client()`` in a worker thread, so the event loop never waits for certifi."""
    return await trio.to_thread.run_sync(build_client)
