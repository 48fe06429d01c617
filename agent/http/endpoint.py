"""The agent's HTTP endpoint: ``/healthz``, ``/status``, ``/metrics`` (read-only) and ``/logs``.

``/status`` is long-polled (``?after=<version>&timeout=<s>``): it answers at once when the state
changed since ``version``, else when it changes or the timeout passes. That is how the head sees a
worker turn healthy within milliseconds without polling a shared file system. ``/logs`` needs the
job's bearer token (``J/token``); nothing served reveals environment values, tokens or prompts.
``/logs`` reads with ``agent.job.logtail``, like ``tilert-submit logs`` on the job directory, so
node-local logs (``agent.logs.location: node``) print the same through it (docs/logs.md).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from agent.http.metrics import CONTENT_TYPE
from agent.job.logfiles import rotated_files
from agent.job.logtail import (
    LIVE,
    LogFollower,
    LogLine,
    history,
    json_lines,
    open_log,
    text_lines,
)
from agent.job.records import AgentStatus
from agent.problems import printable
from agent.web.asgi import (
    App,
    HTTPError,
    Request,
    Response,
    StreamingResponse,
    json_response,
    text_response,
)

MAX_LONG_POLL_S = 60.0
MAX_VERSION_DIGITS = 18  # a version counts changes; more digits than an int64 holds is no version
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


class LogStreams:
    """The ``/logs?follow=1`` streams open now, so that a stopping agent ends them cleanly.

    Without this, the agent's exit would cut every stream before its last lines (the engine's
    ``=== ... stopped ===`` marker): ``close`` makes each one read what is left, send it and end.
    """

    def __init__(self) -> None:
        self.closing = trio.Event()
        self._open = 0
        self._none_open = trio.Event()
        self._none_open.set()

    def opened(self) -> None:
        """A stream started."""
        self._open += 1
        self._none_open = trio.Event()

    def ended(self) -> None:
        """A stream ended."""
        self._open -= 1
        if self._open == 0:
            self._none_open.set()

    async def close(self, timeout_s: float = 2.0) -> None:
        """End every stream after a last read; returns when they have, or after ``timeout_s``."""
        self.closing.set()
        with trio.move_on_after(timeout_s):
            await self._none_open.wait()


def status_body(status: AgentStatus) -> dict[str, object]:
    """The ``/status`` JSON: ``router`` only where there is one (prefill-0), as docs/agent.md says,
    ``convert`` only while converting, ``problems`` only when there are some."""
    body = msgspec.structs.asdict(status)  # nested Structs stay Structs: msgspec encodes them
    for optional in ("router", "convert"):
        if body[optional] is None:
            del body[optional]
    if not body["problems"]:
        del body["problems"]
    return body


def _finite(request: Request, key: str, what: str) -> float | None:
    """A number query parameter that must be finite (``nan``, ``inf`` are the client's error)."""
    value = request.query.get(key)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise HTTPError(400, f"query parameter {key}={printable(value[:40])} is not {what}")
    return number


def _seconds(request: Request, key: str, default: float, limit: float) -> float:
    """A duration query parameter: a finite number >= 0, at most ``limit`` (larger ones are cut)."""
    what = "a number of seconds >= 0"
    seconds = _finite(request, key, what)
    if seconds is None:
        return default
    if seconds < 0:
        raise HTTPError(400, f"query parameter {key}={seconds:g} is not {what}")
    return min(limit, seconds)


def _version(request: Request, key: str) -> int:
    """A ``/status`` version: a whole number (``-1`` asks for the status at once)."""
    value = request.query.get(key, "")
    digits = value[1:] if value.startswith("-") else value
    if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_VERSION_DIGITS):
        raise HTTPError(400, f"query parameter {key}={printable(value[:40])} is not a version")
    return int(value)


def _count(request: Request, key: str, default: int) -> int:
    """A non-negative integer query parameter (``tail=nan`` or ``tail=-1`` is the client's
    error)."""
    value = request.query.get(key)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()):
        raise HTTPError(400, f"query parameter {key}={value!r} is not a whole number >= 0")
    return int(value)


def _tail(request: Request) -> int | None:
    """``tail=N`` (default 200), or ``tail=all`` for the whole history, rotated files first."""
    if request.query.get("tail") == "all":
        return None
    return _count(request, "tail", 200)


def _since(request: Request) -> float | None:
    """``since=<Unix seconds>``: only lines received from then on."""
    return _finite(request, "since", "a time in Unix seconds")


def _exists(path: Path) -> bool:
    """Whether ``path`` or one of its rotated files exists."""
    return path.exists() or bool(rotated_files(path))


def _flag(request: Request, key: str) -> bool:
    return request.query.get(key) in ("1", "true", "yes")


def _scrape_budget(request: Request) -> float | None:
    """The share of Prometheus' scrape timeout the upstream fetch may spend, if it said one."""
    # Prometheus says how long it will wait; the upstream fetch must leave room for our page,
    # or a hanging vLLM would cost the agent's own series that scrape.
    header = request.headers.get("x-prometheus-scrape-timeout-seconds")
    if not header:
        return None
    try:
        return max(0.05, float(header) * SCRAPE_BUDGET_SHARE)
    except ValueError:
        return None


def _authorize(request: Request, token: str) -> None:
    """Refuse (401) a request without the job's bearer token."""
    given = request.headers.get("authorization", "")
    expected = f"Bearer {token}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPError(
            401, "missing or wrong bearer token; send 'Authorization: Bearer <J/token>'"
        )


@dataclass(frozen=True)
class LogQuery:
    """What a ``/logs`` request asks for, checked."""

    path: Path
    tail: int | None
    since: float | None
    timestamps: bool
    follow: bool
    as_json: bool

    @classmethod
    def parse(cls, request: Request, files: dict[str, Path]) -> LogQuery:
        """The query of ``request`` over the logs ``files`` (400/404 for what is not served)."""
        name = request.query.get("name", "engine")
        # Only names from this fixed map are served, so no request can reach outside J/logs.
        if name not in files:
            raise HTTPError(404, f"no log {name!r} here; known: {', '.join(sorted(files))}")
        tail = _tail(request)
        since = _since(request)
        timestamps = _flag(request, "timestamps")
        follow = _flag(request, "follow")
        form = request.query.get("format", "text")
        if form not in ("text", "json"):
            raise HTTPError(400, f"query parameter format={form!r}: use text or json")
        return cls(files[name], tail, since, timestamps, follow, form == "json")

    def wire_lines(self, lines: list[LogLine]) -> bytes:
        """``lines`` as sent: JSON lines or text."""
        return json_lines(lines) if self.as_json else text_lines(lines, self.timestamps)


async def _log_chunks(
    reader: LogFollower, query: LogQuery, streams: LogStreams
) -> AsyncIterator[bytes]:
    """The ``/logs`` body: the history, then (``follow``) live batches until the agent stops."""
    # Streamed batch by batch, each read in a worker thread: J/logs is often NFS, where
    # reading can stall for seconds, and the agent's probes and /status share this loop.
    try:
        past = history(reader, rotated=query.tail is None)
        while (batch := await trio.to_thread.run_sync(next, past, None)) is not None:
            yield query.wire_lines(batch)
        if not query.follow:
            if last := await trio.to_thread.run_sync(reader.finish):
                yield query.wire_lines(last)
            return
        if query.as_json:
            yield LIVE
        streams.opened()
        try:
            async for batch in reader.batches(stop=streams.closing):
                yield query.wire_lines(batch)
        finally:
            streams.ended()
    finally:
        reader.close()


def build_app(
    *,
    feed: StatusFeed,
    metrics_page: Callable[[float | None], Awaitable[str]],
    token: Callable[[], str],
    log_files: Callable[[], dict[str, Path]],
    log_streams: LogStreams | None = None,
) -> App:
    """The agent's ASGI app."""
    streams = log_streams if log_streams is not None else LogStreams()
    app = App()

    @app.route("GET", "/healthz")
    async def healthz(_request: Request) -> Response | StreamingResponse:
        return text_response("ok\n")

    @app.route("GET", "/status")
    async def status(request: Request) -> Response | StreamingResponse:
        after = request.query.get("after")
        if after is None:
            return json_response(status_body(feed.current()))
        timeout = _seconds(request, "timeout", 30.0, MAX_LONG_POLL_S)
        version = _version(request, "after")
        return json_response(status_body(await feed.wait_after(version, timeout)))

    @app.route("GET", "/metrics")
    async def metrics(request: Request) -> Response | StreamingResponse:
        page = await metrics_page(_scrape_budget(request))
        return text_response(page, content_type=CONTENT_TYPE)

    @app.route("GET", "/logs")
    async def logs(request: Request) -> Response | StreamingResponse:
        _authorize(request, token())
        query = LogQuery.parse(request, log_files())
        path = query.path
        if not query.follow and not await trio.to_thread.run_sync(_exists, path):
            raise HTTPError(404, f"{path} does not exist yet")
        reader = open_log(
            path, tail_lines=query.tail, since=query.since, timestamps=query.timestamps
        )
        return StreamingResponse(_log_chunks(reader, query, streams))

    return app
