"""What a job serves over HTTP: the agents' ``/status`` and ``/metrics``, the router's OpenAI API.

``LongPoll`` sends a long-polled ``/status`` on a socket of its own, so a test can wait until the
agent has read the request (and so holds it) before it changes what the poll waits for: no sleep
that hopes the request is in flight by then.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h11
import httpx

from tests.kit.jobdir import agent_entry, record


def get(url: str, **kwargs: Any) -> httpx.Response:
    """GET with a short timeout (the agents answer within milliseconds)."""
    return httpx.get(url, timeout=10, **kwargs)


def exchange(port: int, request: bytes, timeout: float = 30.0) -> bytes:
    """Send raw ``request`` bytes on a new connection to 127.0.0.1:``port`` and read until the
    server closes it (each read bounded by ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data


def agent_status(status_url: str) -> dict[str, Any]:
    """An agent's live ``/status``."""
    response = httpx.get(status_url, timeout=5)
    response.raise_for_status()
    status: dict[str, Any] = response.json()
    return status


def metric_value(metrics_url: str, family: str) -> float | None:
    """The first sample of ``family`` on a /metrics page, or None when absent."""
    text = httpx.get(metrics_url, timeout=5).text
    for line in text.splitlines():
        if line.startswith(family) and line[len(family)] in " {":
            return float(line.rsplit(" ", 1)[1])
    return None


class LongPoll:
    """``GET /status?after=VERSION&timeout=T`` to the agent on 127.0.0.1:``port``, sent at once."""

    def __init__(self, port: int, after: int, timeout_s: float) -> None:
        self.port = port
        self._conn = h11.Connection(our_role=h11.CLIENT)
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 10)
        request = h11.Request(
            method="GET",
            target=f"/status?after={after}&timeout={timeout_s:g}",
            headers=[("Host", f"127.0.0.1:{port}"), ("Connection", "close")],
        )
        self.sent_at = time.monotonic()
        data = self._conn.send(request) or b""
        self._sock.sendall(data + (self._conn.send(h11.EndOfMessage()) or b""))

    def read_by_agent(self) -> bool:
        """The agent has read the whole request: the kernel acknowledged every byte to us and
        holds none unread on the agent's end (/proc/net/tcp's queues of both ends)."""
        ours = self._sock.getsockname()[1]
        tx_ours = rx_agent = None
        with open("/proc/net/tcp") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
                tx, rx = (int(n, 16) for n in fields[4].split(":"))
                if (local, remote) == (ours, self.port):
                    tx_ours = tx
                elif (local, remote) == (self.port, ours):
                    rx_agent = rx
        return tx_ours == 0 and rx_agent == 0

    def answer(self) -> tuple[dict[str, Any], float]:
        """The answer's JSON body and the seconds from sending the request to its end."""
        status = None
        body = b""
        with self._sock:
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:
                    self._conn.receive_data(self._sock.recv(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
        elapsed = time.monotonic() - self.sent_at
        assert status == 200, (status, body)
        answer: dict[str, Any] = json.loads(body)
        return answer, elapsed


# ---- the router ------------------------------------------------------------------------------


def chat(router_url: str, model: str, prompt: str = "Hello", timeout: float = 30.0) -> str:
    """One streaming chat completion through the router; the generated text (raises on error)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "stream": True,
    }
    text = ""
    with httpx.stream(
        "POST", f"{router_url}/v1/chat/completions", json=body, timeout=timeout
    ) as response:
        if response.status_code != 200:
            raise AssertionError(f"router answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                continue
            chunk = json.loads(line[5:])
            assert "error" not in chunk, chunk
            assert chunk.get("model") == model, chunk
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def chat_concurrently(router_url: str, model: str, count: int) -> list[str]:
    """``count`` streaming chats at once; their texts."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(chat, router_url, model, f"Hello {i}") for i in range(count)]
        return [f.result() for f in futures]


def router_serves_without(job: Path, status: dict[str, Any], name: str) -> bool:
    """The router is healthy, and its running generation was launched without agent ``name``
    (its pid is the one of the last ``=== router generation`` line in router.log)."""
    head = agent_status(agent_entry(status, "prefill-0")["status_url"]).get("router")
    if head is None or head["state"] != "healthy":
        return False
    log = job / "logs" / "prefill-0" / "router.log"
    starts = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("=== router")]
    if not starts or f"pid {head['pid']}:" not in starts[-1]:
        return False
    http = record(job, name)["ports"]["http"]
    return f":{http} " not in starts[-1] and not starts[-1].endswith(f":{http}")


def head_status(status: dict[str, Any]) -> dict[str, Any]:
    """The head agent's live ``/status``."""
    return agent_status(agent_entry(status, "prefill-0")["status_url"])


def router_decodes(job: Path, status: dict[str, Any]) -> list[str] | None:
    """The ``--decode`` specs of the router's running generation, once it is healthy."""
    head = head_status(status).get("router")
    if head is None or head["state"] != "healthy":
        return None
    log = job / "logs" / "prefill-0" / "router.log"
    starts = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("=== router")]
    if not starts or f"pid {head['pid']}:" not in starts[-1]:
        return None
    argv = starts[-1].split()
    specs = argv[argv.index("--decode") + 1 :]
    return list(itertools.takewhile(lambda a: not a.startswith("--"), specs))


def decode_spec(job: Path, name: str) -> str:
    """``host:ctrl:http`` of decode ``name``, as the router is given it."""
    found = record(job, name)
    return f"{found['address']}:{found['ports']['ctrl']}:{found['ports']['http']}"
