"""The chaos benchmark's clients: ``clients`` threads streaming one chat after another and
recording each as it ended (``tests.bench.chaosplan.Request``): the whole answer, a failure, a
stream ended by the visible ``stream_truncated`` error event, or a silent cut (it ended as if
complete with less than the stand-in's whole answer).

A client is polite as ``tests/kit/chatload.py``'s is: a refused connection and a ``429`` (the
router's backpressure) are sent again after 50 ms, within ``RETRY_BUDGET_S``, and counted as the
client's own retries; nothing else is retried by the client (that is the front's work)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.bench.chaosplan import Outcome, Request

RETRY_S = 0.05
RETRY_BUDGET_S = 60.0
READ_TIMEOUT_S = 60.0


class _Refused(Exception):
    """Sent again by the client: a refused connection or a 429."""


@dataclass
class _Attempt:
    outcome: Outcome = "ok"
    first_byte: float | None = None
    error: str = ""
    text: str = ""


def _event(chunk: dict[str, Any], got: _Attempt) -> bool:
    """Take one SSE data chunk; True once it ended the stream with an error."""
    error = chunk.get("error")
    if error is not None:
        kind = error.get("type") if isinstance(error, dict) else None
        got.outcome = "truncated" if kind == "stream_truncated" else "failed"
        got.error = f"error event: {json.dumps(error)[:300]}"
        return True
    for choice in chunk.get("choices") or []:
        got.text += (choice.get("delta") or {}).get("content") or ""
    return False


def _stream(client: httpx.Client, url: str, body: dict[str, Any], answer: str) -> _Attempt:
    got = _Attempt()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code == 429:
            raise _Refused("429")
        if response.status_code != 200:
            response.read()
            return _Attempt("failed", error=f"HTTP {response.status_code}: {response.text[:300]}")
        done = False
        for line in response.iter_lines():
            if got.first_byte is None:
                got.first_byte = time.monotonic()
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                done = True
                break
            if data and _event(json.loads(data), got):
                return got
    if not done:
        return _Attempt("failed", got.first_byte, "the stream ended without [DONE]", got.text)
    if got.text != answer:
        got.outcome = "cut"
        got.error = f"answer cut silently: {got.text!r}"
    return got


@dataclass
class ChaosLoad:
    """``clients`` threads chatting at ``url`` until ``stop``, every request recorded."""

    url: str
    model: str
    answer: str
    clients: int = 2
    max_tokens: int = 64
    requests: list[Request] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, client: httpx.Client) -> Request:
        """One chat to its end, retrying a refused connection or a 429 within the budget."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        start = time.monotonic()
        retries = 0
        while True:
            try:
                got = _stream(client, self.url, body, self.answer)
            except (httpx.ConnectError, _Refused) as exc:
                if time.monotonic() - start > RETRY_BUDGET_S or self.stop.is_set():
                    got = _Attempt("failed", error=f"refused past the client's budget: {exc}")
                else:
                    retries += 1
                    time.sleep(RETRY_S)
                    continue
            except (httpx.HTTPError, ValueError) as exc:
                got = _Attempt("failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return Request(start, time.monotonic(), got.outcome, got.first_byte, retries, got.error)

    def _run(self) -> None:
        timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
        with httpx.Client(timeout=timeout) as client:
            while not self.stop.is_set():
                request = self.one(client)
                with self._lock:
                    self.requests.append(request)

    def start(self) -> ChaosLoad:
        """Start the clients."""
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def finish(self, timeout: float = 90.0) -> list[Request]:
        """Stop the clients once their current chats are done; every request recorded."""
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            return list(self.requests)
