"""vLLM's /metrics fetched for the re-export: bounded in time and size, cached, then relabelled.

``UpstreamMetrics`` is the I/O around ``agent.http.reexport`` (which reads and relabels a page):
one fetch at a time, ``Accept`` asking for the classic text format, a size cap checked while the
body streams, a deadline from Prometheus' scrape budget, and ``up``/``last_error`` for the agent's
own page when the upstream fails (docs/metrics.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping

import httpx
import trio

from agent.errors import RuntimeFailure
from agent.http.reexport import ACCEPT, PageError, Relabeller, check_labels

log = logging.getLogger(__name__)

# Up to this size a page of the last one's shape is relabelled on the event loop (~5 ms a MiB).
_REUSE_ON_LOOP_BYTES = 1024 * 1024


class UpstreamError(RuntimeFailure):
    """The upstream answer is unusable before parsing (status, type, size, time)."""


class UpstreamMetrics:
    """The prefill engine's vLLM /metrics, re-served with role/node/slurm_job_id added."""

    def __init__(
        self,
        url: str,
        labels: Mapping[str, str],
        *,
        timeout_s: float = 2.0,
        max_bytes: int = 16 * 1024 * 1024,
        cache_s: float = 1.0,
        reserved_names: Collection[str] = (),
    ) -> None:
        check_labels(labels)
        self.url = url
        self.labels = dict(labels)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache_s = cache_s
        self.reserved_names = frozenset(reserved_names)
        self.up = False
        self.last_error: str | None = None
        self.last_duration_s: float | None = None
        self.last_bytes = 0
        self._text = ""
        self._fetched_at: float | None = None  # when the last refresh STARTED
        self._lock = trio.Lock()  # one fetch at a time; scrapes that queue behind it reuse it
        self._relabeller: Relabeller | None = None

    async def render(self, client: httpx.AsyncClient, *, budget_s: float | None = None) -> str:
        """The relabelled page (cached for ``cache_s``); "" when the fetch or parse failed.

        ``budget_s`` shortens the fetch timeout for this call (the scraper's own deadline). The age
        counts from the start of the refresh: counted from its end, scrapes a little more than
        ``cache_s`` apart would alternate between a fetch and the cache.
        """
        async with self._lock:
            now = time.monotonic()
            if self._fetched_at is None or now - self._fetched_at >= self.cache_s:
                self._text = await self._refresh(client, budget_s)
                self._fetched_at = now
            return self._text

    def relabeller(self) -> Relabeller:
        """The relabeller for the current ``labels`` and ``reserved_names``."""
        current = self._relabeller
        if (
            current is None
            or current.labels != self.labels
            or current.reserved_names != self.reserved_names
        ):
            current = self._relabeller = Relabeller(self.labels, reserved_names=self.reserved_names)
        return current

    async def _refresh(self, client: httpx.AsyncClient, budget_s: float | None = None) -> str:
        started = time.monotonic()
        self.last_bytes = 0
        timeout_s = self.timeout_s if budget_s is None else min(self.timeout_s, budget_s)
        try:
            with trio.move_on_after(timeout_s) as deadline:
                body = await self._fetch(client)
            if deadline.cancelled_caught:
                raise UpstreamError(f"no complete answer within {timeout_s:g} s")
            try:
                page = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PageError(f"the page is not UTF-8 (byte {exc.start})") from None
            # The last page's shape is reused on the loop (a thread hop costs as much under load);
            # a new one is parsed whole in a worker thread (~25 ms for 5,000 lines).
            relabeller = self.relabeller()
            text = relabeller.reuse(page) if len(body) <= _REUSE_ON_LOOP_BYTES else None
            if text is None:
                text = await trio.to_thread.run_sync(relabeller.parse, page)
        except Exception as exc:  # whatever upstream does, the agent's own page stays up
            if not isinstance(exc, UpstreamError | PageError | httpx.HTTPError | OSError):
                log.exception("re-exporting %s failed unexpectedly", self.url)
            self.up = False
            self.last_error = f"{self.url}: {_describe(exc)}"
            text = ""
        else:
            self.up = True
            self.last_error = None
        self.last_duration_s = time.monotonic() - started
        return text

    async def _fetch(self, client: httpx.AsyncClient) -> bytes:
        """The body, read while streaming and refused as soon as it passes ``max_bytes``."""
        headers = {"Accept": ACCEPT, "Accept-Encoding": "identity"}
        async with client.stream("GET", self.url, headers=headers, timeout=self.timeout_s) as resp:
            if resp.status_code != 200:
                raise UpstreamError(f"HTTP {resp.status_code}")
            ctype = resp.headers.get("content-type", "text/plain")
            if not ctype.lower().startswith("text/plain"):
                raise UpstreamError(f"content-type {ctype!r}, expected text/plain (classic text)")
            encoding = resp.headers.get("content-encoding", "identity").lower()
            if encoding not in ("", "identity"):
                raise UpstreamError(f"content-encoding {encoding!r} although identity was asked")
            length = resp.headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise UpstreamError(f"page of {length} bytes is over the {self.max_bytes} limit")
            chunks = []
            async for chunk in resp.aiter_raw():
                self.last_bytes += len(chunk)
                if self.last_bytes > self.max_bytes:
                    raise UpstreamError(f"page is over the {self.max_bytes}-byte limit")
                chunks.append(chunk)
        return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    """A one-line reason for ``last_error``."""
    if isinstance(exc, UpstreamError | PageError):
        return str(exc)
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})" if str(exc) else "cannot connect"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
