"""The front door's way to the router: tries, waits for a router being handed over, and the
streamed reply passed on event by event.

The router's address is asked for at every try (``RouterNow``), so a restarted or handed-over
router is followed. While the head's supervisor says the router is (re)starting, a try waits for
it (woken by the head's changes, bounded by the request's budget) instead of being refused; that
wait is not a try. A try that failed before the client's first byte is tried again as the recipe's
``agent.front.retry`` allows (the rules are ``agent.front.retry``'s). A stream's first byte is its
first content (or its end): events before it (the role chunk) are held, so a stream that fails
before its first token is tried again too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import trio

from agent.front.retry import (
    Failure,
    RetryBudget,
    connect_failure,
    status_failure,
    stream_failure,
)
from agent.front.sse import EventSplitter, StreamWatch

WAIT_POLL_S = 0.5  # a safety net: the head's changes wake waiting requests before this
MAX_REPLY_BYTES = 64 << 20  # a non-streamed reply, or a refusal's body, read at most this far
CONNECT_TIMEOUT_S = 5.0
# A stream may wait this long for its next event (TileRT's own bound: TILERT_PD_HTTP_TIMEOUT_S).
READ_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class RouterNow:
    """The router as the head sees it now: its URL (None: none started, or the job ended) and
    whether its supervisor says it serves (False: starting, restarting, unhealthy)."""

    url: str | None
    serving: bool
    why: str = ""


class Unavailable(Exception):
    """No router can take the request within its budget: 503 with Retry-After."""


@dataclass
class StreamStart:
    """A stream that passed its first content: the events for the client so far, the rest."""

    first: list[bytes]
    chunks: AsyncIterator[bytes]
    splitter: EventSplitter
    watch: StreamWatch


@dataclass
class Opened:
    """A router reply that passed: a stream (``stream``) or a whole body."""

    response: httpx.Response
    tries: int
    body: bytes = b""
    stream: StreamStart | None = None


@dataclass
class Refused:
    """The router's last answer when it was not retried (or out of budget)."""

    failure: Failure
    tries: int
    content: bytes = b""


def make_client() -> httpx.AsyncClient:
    """The front's own client to the router: keep-alive, no overall timeout on a stream."""
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, write=60.0, pool=60.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


class Proxy:
    """Tries a request at the router until one answer passes or the budget is spent."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        router: Callable[[], RouterNow],
        budget: RetryBudget,
        on_retry: Callable[[str], None],
    ) -> None:
        self.client = client
        self.router = router
        self.budget = budget
        self.on_retry = on_retry
        self._wake = trio.Event()

    def changed(self) -> None:
        """The head saw a change (the router's state among them): waiting tries look again."""
        self._wake.set()
        self._wake = trio.Event()

    async def router_url(self, deadline: float) -> str:
        """The serving router's URL; waits while it is being (re)started, up to ``deadline``."""
        while True:
            now = self.router()
            if now.url is None:
                raise Unavailable(now.why or "no router serves this job yet")
            if now.serving:
                return now.url
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise Unavailable(f"the router did not come back within the budget: {now.why}")
            with trio.move_on_after(min(remaining, WAIT_POLL_S)):
                await self._wake.wait()

    async def send(
        self, path: str, body: bytes, *, stream: bool, want_usage: bool = False
    ) -> Opened | Refused:
        """Try ``body`` at the router's ``path`` until an answer passes or the budget ends."""
        start = trio.current_time()
        deadline = start + self.budget.budget_s
        tries = 0
        while True:
            url = await self.router_url(deadline)
            tries += 1
            result = await self._try(url + path, body, stream, tries, want_usage)
            if isinstance(result, Opened):
                return result
            delay = self.budget.next_delay(result, tries, trio.current_time() - start)
            if delay is None:
                content = result.message.encode()
                return Refused(result, tries, content)
            self.on_retry(result.reason)
            await trio.sleep(delay)

    async def _try(
        self, url: str, body: bytes, stream: bool, tries: int, want_usage: bool
    ) -> Opened | Failure:
        headers = {"content-type": "application/json", "accept": "*/*"}
        request = self.client.build_request("POST", url, content=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            return connect_failure(f"the router at {url} did not answer: {exc!r}")
        try:
            if response.status_code != 200:
                content = await _read_bounded(response)
                return status_failure(response.status_code, content.decode(errors="replace"))
            if not stream:
                return Opened(response, tries, body=await _read_bounded(response))
            opened = await _first_events(response, tries, StreamWatch(want_usage=want_usage))
        except httpx.TransportError as exc:
            await response.aclose()
            return connect_failure(f"the router at {url} dropped the reply: {exc!r}")
        if isinstance(opened, Failure):
            await response.aclose()
            return opened
        return opened


async def _read_bounded(response: httpx.Response) -> bytes:
    """A whole reply body, at most ``MAX_REPLY_BYTES`` (the rest dropped), the reply closed."""
    parts, size = [], 0
    try:
        async for part in response.aiter_raw():
            parts.append(part)
            size += len(part)
            if size > MAX_REPLY_BYTES:
                break
    finally:
        await response.aclose()
    return b"".join(parts)


async def _first_events(
    response: httpx.Response, tries: int, watch: StreamWatch
) -> Opened | Failure:
    """Read the stream up to its first content (or its end); a cut before that is a failure
    (nothing reached the client yet: it may be tried again)."""
    chunks = response.aiter_raw()
    splitter = EventSplitter()
    out: list[bytes] = []
    async for data in chunks:
        for event in splitter.feed(data):
            out += watch.push(event)
        if watch.truncated is not None:
            return stream_failure(f"the stream failed before its first token: {watch.truncated}")
        if watch.chunks > 0 or watch.done:
            return Opened(response, tries, stream=StreamStart(out, chunks, splitter, watch))
    watch.end()
    return stream_failure(f"the stream ended before its first event: {watch.truncated}")
