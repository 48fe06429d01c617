"""Chats through the router as a client sends them: one streamed chat (``stream_chat``), and a
steady load (``ChatLoad``) that retries a refused connection (a router restarting) and a
``429 decode_busy`` (TileRT's router has no free decode: its backpressure, which a client retries)
and records every attempt, so a test or benchmark can say what a router hand-over cost: how long
connections were refused, how often the pool was busy, and which requests failed otherwise."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_S = 0.05


class Busy(AssertionError):
    """The router answered 429: every decode in its list is busy (retry later)."""


def stream_chat(url: str, model: str, started: threading.Event | None = None) -> dict[str, Any]:
    """One streaming chat: its text, its chunks, its finish reason and whether it ended with
    ``[DONE]`` (raises on an error; ``started`` is set once text arrived)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 64,
        "stream": True,
    }
    text, chunks, finish, done = "", 0, None, False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        if response.status_code == 429:
            raise Busy(f"router answered 429: {response.read()!r}")
        if response.status_code != 200:
            raise AssertionError(f"router answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            done = done or line[5:].strip() == "[DONE]"
            if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise AssertionError(f"error chunk: {chunk}")
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if started is not None and text:
                started.set()
    return {"text": text, "chunks": chunks, "finish": finish, "done": done}


@dataclass
class ChatLoad:
    """``clients`` threads chatting one chat after another until ``stop``; a refused connection
    is retried after ``RETRY_S`` (and its time kept), so is a busy pool (counted), any other
    failure is kept (with ``answer``: a chat whose text is not it, or that ended without
    ``[DONE]``, is one)."""

    url: str
    model: str
    clients: int = 1
    answer: str | None = None
    served: int = 0
    # Monotonic times of refused connections, and of the first chat served after each refusal.
    refused_at: list[float] = field(default_factory=list)
    back_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    busy: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self) -> None:
        refused = False
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                got = stream_chat(self.url, self.model)
                if self.answer is not None and (got["text"], got["done"]) != (self.answer, True):
                    raise AssertionError(f"not the whole answer: {got}")
            except httpx.ConnectError:
                with self._lock:
                    self.refused_at.append(time.monotonic())
                refused = True
                time.sleep(RETRY_S)
                continue
            except Busy:
                with self._lock:
                    self.busy += 1
                time.sleep(RETRY_S)
                continue
            except (httpx.HTTPError, AssertionError) as exc:
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.served += 1
                if refused:
                    self.back_at.append(began)  # the router accepted this one
            refused = False

    def start(self) -> ChatLoad:
        """Start the clients."""
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def finish(self, timeout: float = 120.0) -> None:
        """Stop the clients once their current chats are done."""
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def gaps(self) -> list[float]:
        """Each stretch of refused connections, in seconds: from its first refusal to the start
        of the first chat served after it (a refusal starts a stretch when none is open)."""
        out: list[float] = []
        events = sorted(
            [(t, "refused") for t in self.refused_at] + [(t, "back") for t in self.back_at]
        )
        opened: float | None = None
        for at, what in events:
            if what == "refused" and opened is None:
                opened = at
            elif what == "back" and opened is not None:
                out.append(at - opened)
                opened = None
        return out
