"""The loads ``tests/bench/frontcost.py`` puts on each path: streamed chats one at a time, many
clients streaming at once (each request's time to first byte), and streams read as fast as a
path passes them (events per second). The many-client loads are raw asyncio sockets, one
``Connection: close`` request each, so the client's own cost is the same small one on every path.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import psutil

EVENT_END = b"\n\n"


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process ``pid`` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def chat_body(model: str, max_tokens: int, *, long: bool) -> dict[str, object]:
    """A streamed chat asking for ``max_tokens`` (``long``: all of them, ``ignore_eos``)."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    if long:
        body["ignore_eos"] = True
    return body


def timed_chat(client: httpx.Client, url: str, body: dict[str, object]) -> tuple[float, int]:
    """One streamed chat read to its end: its seconds and the bytes it streamed."""
    start = time.perf_counter()
    size = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read()!r}")
        for chunk in response.iter_raw():
            size += len(chunk)
    return time.perf_counter() - start, size


def _request(url: str, body: dict[str, object]) -> tuple[str, int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return host, int(port), head + payload


@dataclass
class Read:
    """One raw request's reply: its time to first byte of an event, its events, its status."""

    ttfb_s: float
    events: int
    ok: bool


async def raw_stream(url: str, body: dict[str, object]) -> Read:
    """One streamed chat over a connection of its own, read to its end; events counted by their
    blank lines (the chunked framing never makes one)."""
    host, port, request = _request(url, body)
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    ttfb, events, carry, head = 0.0, 0, b"", b""
    try:
        writer.write(request)
        while data := await reader.read(65536):
            if not ttfb and b"data:" in data:
                ttfb = time.perf_counter() - start
            if not head:
                head = data[:12]
            joined = carry + data
            events += joined.count(EVENT_END)
            carry = joined[-1:]
    finally:
        writer.close()
    return Read(ttfb, events, head.startswith(b"HTTP/1.1 200"))


async def _clients(url: str, body: dict[str, object], clients: int, each: int) -> list[Read]:
    reads: list[Read] = []

    async def client() -> None:
        for _ in range(each):
            reads.append(await raw_stream(url, body))

    await asyncio.gather(*(client() for _ in range(clients)))
    return reads


def many_clients(url: str, body: dict[str, object], clients: int, each: int) -> list[Read]:
    """``clients`` clients streaming at once, ``each`` requests one after the other."""
    return asyncio.run(_clients(url, body, clients, each))


def saturate(url: str, body: dict[str, object], streams: int) -> tuple[int, int, float]:
    """``streams`` streams at once, read as fast as they come: the events, the seconds from the
    first request to the last byte, and the failed replies."""
    start = time.perf_counter()
    reads = asyncio.run(_clients(url, body, streams, 1))
    took = time.perf_counter() - start
    return sum(r.events for r in reads), sum(not r.ok for r in reads), took
