"""The agent's HTTP endpoint: ``/healthz``, ``/status``, ``/metrics`` (read-only) and ``/logs``.

``/status`` is long-polled (``?after=<version>&timeout=<s>``): it answers at once when the state
changed since ``version``, else when it changes or the timeout passes. That is how the head sees a
worker turn healthy within milliseconds without polling a shared file system. ``/logs`` needs the
job's bearer token (``J/token``); nothing served reveals environment values, tokens or prompts.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import trio

from agent.http.asgi import (
    App,
    HTTPError,
    Request,
    Response,
    StreamingResponse,
    json_response,
    text_response,
)
from agent.http.metrics import CONTENT_TYPE
from agent.job.logtail import LogFollower, follow_file
from agent.job.records import AgentStatus

MAX_LONG_POLL_S = 60.0
# The share of Prometheus' scrape timeout the vLLM re-export may spend.
SCRAPE_BUDGET_SHARE = 0.5


class StatusFeed:
    """The agent's current ``AgentStatus`` with a version that bumps on every change."""

    def __init__(self, snapshot: Callable[[], AgentStatus]) -> None:
        self._snapshot = snapshot
        self.version = 0
        self._changed = trio.Event()

    def bump(self) -> None:
        """Something changed: wake every long-poller."""
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()

    def current(self) -> AgentStatus:
        """The status now, stamped with the version."""
        status = self._snapshot()
        status.version = self.version
        return status

    async def wait_after(self, version: int, timeout_s: float) -> AgentStatus:
        """The status once its version exceeds ``version``, or after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while self.version <= version:
                await self._changed.wait()
        return self.current()


def status_body(status: AgentStatus) -> dict[str, object]:
    """The ``/status`` JSON: ``router`` only where there is one (prefill-0), as DESIGN.md says,
    and ``convert`` only while converting."""
    body = msgspec.structs.asdict(status)  # nested Structs stay Structs: msgspec encodes them
    for optional in ("router", "convert"):
        if body[optional] is None:
            del body[optional]
    return body


def _number(request: Request, key: str, default: float) -> float:
    value = request.query.get(key)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise HTTPError(400, f"query parameter {key}={value!r} is not a number") from None


def _count(request: Request, key: str, default: int) -> int:
    """A non-negative integer query parameter (``tail=nan`` or ``tail=-1`` is the client's error)."""
    value = request.query.get(key)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()):
        raise HTTPError(400, f"query parameter {key}={value!r} is not a whole number >= 0")
    return int(value)


def build_app(
    *,
    feed: StatusFeed,
    metrics_page: Callable[[float | None], Awaitable[str]],
    token: Callable[[], str],
    log_files: Callable[[], dict[str, Path]],
) -> App:
    """The agent's ASGI app."""
    app = App()

    @app.route("GET", "/healthz")
    async def healthz(request: Request) -> Response | StreamingResponse:
        return text_response("ok\n")

    @app.route("GET", "/status")
    async def status(request: Request) -> Response | StreamingResponse:
        after = request.query.get("after")
        if after is None:
            return json_response(status_body(feed.current()))
        timeout = min(MAX_LONG_POLL_S, _number(request, "timeout", 30.0))
        version = int(_number(request, "after", 0))
        return json_response(status_body(await feed.wait_after(version, timeout)))

    @app.route("GET", "/metrics")
    async def metrics(request: Request) -> Response | StreamingResponse:
        # Prometheus says how long it will wait; the upstream fetch must leave room for our page,
        # or a hanging vLLM would cost the agent's own series that scrape.
        budget = None
        header = request.headers.get("x-prometheus-scrape-timeout-seconds")
        if header:
            try:
                budget = max(0.05, float(header) * SCRAPE_BUDGET_SHARE)
            except ValueError:
                budget = None
        return text_response(await metrics_page(budget), content_type=CONTENT_TYPE)

    @app.route("GET", "/logs")
    async def logs(request: Request) -> Response | StreamingResponse:
        given = request.headers.get("authorization", "")
        expected = f"Bearer {token()}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise HTTPError(
                401, "missing or wrong bearer token; send 'Authorization: Bearer <J/token>'"
            )
        files = log_files()
        name = request.query.get("name", "engine")
        # Only names from this fixed map are served, so no request can reach outside J/logs.
        if name not in files:
            raise HTTPError(404, f"no log {name!r} here; known: {', '.join(sorted(files))}")
        tail = _count(request, "tail", 200)
        follow = request.query.get("follow") in ("1", "true", "yes")
        path = files[name]
        if not follow:
            # In a worker thread: J/logs is often NFS, where reading can stall for seconds, and
            # the agent's probes and /status share this event loop.
            reader = LogFollower(path, tail_lines=tail)
            lines = await trio.to_thread.run_sync(reader.finish) if tail > 0 else []
            return text_response("".join(line.rstrip("\n") + "\n" for line in lines))

        async def chunks() -> AsyncIterator[bytes]:
            async for line in follow_file(path, tail_lines=tail):
                yield (line.rstrip("\n") + "\n").encode()

        return StreamingResponse(chunks())

    return app
