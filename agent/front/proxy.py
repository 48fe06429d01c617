"""The front door's way to the router: tries, waits for a router being handed over, a stream
read up to its first content (its rest is passed on by ``agent.front.relay``).

The router's address is asked for at every try (``RouterNow``), so a restarted or handed-over
router is followed. While the head's supervisor says the router is (re)starting, a try waits for
it (woken by the head's changes, bounded by the request's budget) instead of being refused; that
wait is not a try. A try that failed before the client's first byte is tried again as the recipe's
``agent.front.retry`` allows (the rules are ``agent.front.retry``'s). A stream's first byte is its
first content (or its end): events before it (the role chunk) are held, so a stream that fails
before its first token is tried again too. The router is reached through
``agent.front.upstream`` (h11 on trio's streams; an httpx transport handed in, for tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import httpx
import trio

from agent.errors import RuntimeFailure
from agent.front.retry import (
    Failure,
    RetryBudget,
    connect_failure,
    stale_failure,
    status_failure,
    stream_failure,
)
from agent.front.sse import StreamReader, StreamWatch
from agent.front.upstream import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    H11Upstream,
    HttpxUpstream,
    Reply,
    Upstream,
    UpstreamError,
)

WAIT_POLL_S = 0.5  # a safety net: the head's changes wake waiting requests before this
# A stream with no first event this long after an engine restarted and the pool is whole again
# is given up and tried again: its request was lost with the engine (the router would wait for
# KV that never comes, 120 s).
STALE_AFTER_RESTART_S = 5.0
MAX_REPLY_BYTES = 64 << 20  # a non-streamed reply, or a refusal's body, read at most this far


@dataclass(frozen=True)
class RouterNow:
    """The router as the head sees it now: its URL (None: none started, or the job ended) and
    whether its supervisor says it serves (False: starting, restarting, unhealthy)."""

    url: str | None
    serving: bool
    why: str = ""
    # Why the router's pool is not whole now (the prefill or a decode in its list restarting),
    # or None; and the engines' restart counts (a change: an engine restarted).
    settling: str | None = None
    marks: tuple[tuple[str, int], ...] = ()


class Unavailable(RuntimeFailure):
    """No router can take the request within its budget: 503 with Retry-After."""


@dataclass
class StreamStart:
    """A stream that passed its first content: what the client gets so far, the reader of the
    rest."""

    first: list[bytes]
    reader: StreamReader


@dataclass
class Opened:
    """A router reply that passed: a stream (``stream``) or a whole body."""

    response: Reply
    body: bytes = b""
    stream: StreamStart | None = None


@dataclass
class Refused:
    """The router's last answer when it was not retried (or out of budget)."""

    failure: Failure
    tries: int
    content: bytes = b""


def make_client() -> httpx.AsyncClient:
    """An httpx client with the bounds of a stream (keep-alive, no overall timeout): the service
    front's to its cells' ``/v1/models`` (its requests go through ``make_upstream``'s)."""
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, write=60.0, pool=60.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def make_upstream(transport: httpx.AsyncBaseTransport | None = None) -> Upstream:
    """The front's own client to the router: keep-alive, no overall timeout on a stream
    (``transport``: the router in process, for tests/kit/front.py; None: the network)."""
    if transport is None:
        return H11Upstream()
    return HttpxUpstream(httpx.AsyncClient(transport=transport, trust_env=False))


class Proxy:
    """Tries a request at the router until one answer passes or the budget is spent."""

    def __init__(
        self,
        client: Upstream,
        router: Callable[[], RouterNow],
        budget: RetryBudget,
    ) -> None:
        self.client = client
        self.router = router
        self.budget = budget
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
        self,
        path: str,
        body: bytes,
        *,
        stream: bool,
        on_retry: Callable[[str], None],
        want_usage: bool = False,
        new_watch: Callable[[], StreamWatch] | None = None,
    ) -> Opened | Refused:
        """Try ``body`` at the router's ``path`` until an answer passes or the budget ends;
        ``on_retry`` is told each try again's reason (the request's ``Ticket``); a stream is
        watched by a ``new_watch()`` of each try (``agent.front.resume``'s), else a plain one."""
        if new_watch is None:
            new_watch = partial(StreamWatch, want_usage=want_usage)
        start = trio.current_time()
        deadline = start + self.budget.budget_s
        tries = made = 0  # the tries counted (a refused connection is not), and all of them
        while True:
            url = await self.router_url(deadline)
            made += 1
            result = await self._try(url + path, body, stream, new_watch)
            if isinstance(result, Opened):
                return result
            tries += 0 if result.refused else 1
            delay = self.budget.next_delay(result, tries, trio.current_time() - start)
            if delay is None:
                content = result.message.encode()
                return Refused(result, made, content)
            on_retry(result.reason)
            await trio.sleep(delay)
            await self.settle(deadline)

    async def settle(self, deadline: float) -> None:
        """After a failed try: wait (up to ``deadline``) while the router's pool is not whole:
        TileRT's router hands a request to the first free decode, dead or not, so a try before
        the restarting engine is back would fail the same way."""
        while self.router().settling is not None:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                return
            with trio.move_on_after(min(remaining, WAIT_POLL_S)):
                await self._wake.wait()

    async def _try(
        self, url: str, body: bytes, stream: bool, new_watch: Callable[[], StreamWatch]
    ) -> Opened | Failure:
        response: Reply | None = None
        result: Opened | Failure = stale_failure("an engine restarted and the stream had not begun")
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                if stream:
                    nursery.start_soon(self._give_up_if_lost, scope, self.router().marks)
                try:
                    response = await self.client.post(url, body)
                    result = await _answer(response, stream, new_watch)
                except UpstreamError as exc:
                    said = "refused the connection" if exc.refused else "failed to answer"
                    result = connect_failure(
                        f"the router at {url} {said}: {exc}", refused=exc.refused
                    )
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            result = stale_failure("an engine restarted and the stream had not begun")
        if isinstance(result, Failure) and response is not None:
            with trio.CancelScope(shield=True):
                await response.aclose()
        return result

    async def _give_up_if_lost(self, scope: trio.CancelScope, marks: object) -> None:
        """Cancel ``scope`` once an engine restarted since ``marks``, the pool is whole again
        and ``STALE_AFTER_RESTART_S`` passed: the try's request may have died with the engine."""
        while True:
            now = self.router()
            if now.marks != marks and now.settling is None:
                await trio.sleep(STALE_AFTER_RESTART_S)
                scope.cancel()
                return
            with trio.move_on_after(WAIT_POLL_S):
                await self._wake.wait()


async def _answer(
    response: Reply, stream: bool, new_watch: Callable[[], StreamWatch]
) -> Opened | Failure:
    """The router's answer: a failure (its status), a whole body, or a stream begun."""
    if response.status != 200:
        content = await _read_bounded(response)
        return status_failure(response.status, content.decode(errors="replace"))
    if not stream:
        return Opened(response, body=await _read_bounded(response))
    return await _first_events(response, new_watch())


async def _read_bounded(response: Reply) -> bytes:
    """A whole reply body, at most ``MAX_REPLY_BYTES`` (the rest dropped), the reply closed."""
    parts, size = [], 0
    try:
        async for part in response.body():
            parts.append(part)
            size += len(part)
            if size > MAX_REPLY_BYTES:
                break
    finally:
        await response.aclose()
    return b"".join(parts)


async def _first_events(response: Reply, watch: StreamWatch) -> Opened | Failure:
    """Read the stream up to its first content (or its end); a cut before that is a failure
    (nothing reached the client yet: it may be tried again)."""
    reader = StreamReader(response.body(), watch)
    first: list[bytes] = []
    while (out := await reader.read()) is not None:
        first.append(out)
        if watch.truncated is not None:
            return stream_failure(f"the stream failed before its first token: {watch.truncated}")
        if watch.chunks > 0 or watch.done:
            return Opened(response, stream=StreamStart(first, reader))
    reader.end()
    return stream_failure(f"the stream ended before its first event: {watch.truncated}")
