"""Clients a job meets in its first hour, against a running local job (stand-ins, the REAL
TileRT router): pgjones/hypercorn#203's malformed connection at the front and the agents while
chats stream, nginx with its defaults and HAProxy before the front, an HTTP/1.0 client, headers
and bodies no server may answer with a 500 (docs/reliability.md, "Servers contained"; in process:
tests/test_web.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests import kit
from tests.conftest import require
from tests.infra.haproxy import HAProxy, haproxy_binary
from tests.infra.nginx import Nginx, nginx_binary
from tests.kit import FAST
from tests.kit.chatload import ChatLoad
from tests.kit.endpoints import exchange
from tests.test_front import CHAT, MODEL, READY_S, TOKEN_DELAY, events, front
from tests.test_scale import PROBE
from tests.test_web import LATIN1, NESTED, endpoint_app, front_app

pytestmark = pytest.mark.router

MALFORMED_TRIES = 100
WAIT_S = 30.0  # a stream here lasts about 3 s; nginx's own proxy_read_timeout is 60 s
# The stand-ins' routes (agent/standins/prefill.py, decode.py build_app).
PREFILL_ROUTES = [
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]
DECODE_ROUTES = [
    ("GET", "/health"),
    ("GET", "/capabilities"),
    ("GET", "/decode_status"),
    ("POST", "/pd/cancel"),
    ("POST", "/pd/decode"),
]


@pytest.fixture(scope="module")
def job(router_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.LocalJob]:
    """One ready job for the module's tests (none of them changes its pool)."""
    # PROBE: the real router's /health can take over FAST's 0.5 s while 300 connections and two
    # clients load two cores, and three such probes restart it (every stream cut, not ready).
    sets, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, PROBE)
    with kit.LocalJob(tmp_path_factory.mktemp("hostile") / "job", sets) as running:
        running.wait_state("ready", timeout=READY_S)
        yield running


def port_of(job: kit.LocalJob, name: str, kind: str) -> int:
    """Port ``kind`` (agent, http, front) of agent ``name``'s record."""
    port = kit.record(job.job, name)["ports"][kind]
    assert isinstance(port, int)
    return port


def listener(port: int) -> psutil.Process:
    """The process listening on ``port``."""
    for conn in psutil.net_connections("inet"):
        bound = getattr(conn.laddr, "port", None)  # () for a socket bound to nothing
        if conn.status == psutil.CONN_LISTEN and bound == port and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on {port}")


def malformed(port: int, paths: list[str], tries: int) -> None:
    """pgjones/hypercorn#203: ``Connection: close`` requests with stray bytes after them."""
    for i in range(tries):
        path = paths[i % len(paths)]
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nXXXX".encode()
        # The server may close with our stray bytes unread: a reset.
        with contextlib.suppress(ConnectionResetError):
            exchange(port, request)


def test_malformed_connections_lose_no_chat_and_end_no_agent(job: kit.LocalJob) -> None:
    """100 malformed connections at the front, 100 at the head's agent endpoint and 100 at a
    decode's while two clients chat through the front: no chat lost, every agent the same
    process still serving, the job ready; no connection even failed (the race is avoided)."""
    url = front(job)
    targets = {
        port_of(job, "prefill-0", "front"): ["/health", "/v1/models"],
        port_of(job, "prefill-0", "agent"): ["/healthz", "/status"],
        port_of(job, "decode-0", "agent"): ["/healthz", "/status"],
    }
    agents = {port: listener(port) for port in targets}
    load = ChatLoad(url, MODEL, clients=2).start()
    kit.wait_for("chats served", lambda: load.served >= 2, 60)
    for port, paths in targets.items():
        malformed(port, paths, MALFORMED_TRIES)
    served = load.served
    kit.wait_for("chats after", lambda: load.served >= served + 2, 60)
    load.finish()
    print(f"\nserved {load.served}, failures {load.failures}")
    assert load.failures == []
    assert not load.refused_at
    assert load.busy == 0
    for port, proc in agents.items():
        assert proc.is_running(), f"the agent on {port} exited"
        assert listener(port).pid == proc.pid
    assert job.status()["state"] == "ready"
    logs = "".join(p.read_text(errors="replace") for p in (job.job / "logs").rglob("agent*.log"))
    assert "a connection failed" not in logs


def test_a_stream_through_nginx_with_its_defaults_ends_at_its_last_event(
    job: kit.LocalJob, tmp_path: Path
) -> None:
    """nginx (HTTP/1.0 to the front, buffering off, its 60 s read timeout) passes a streamed
    chat that ends with its last event: the client's read timeout, half nginx's, would fire
    first if the front kept the connection, and nginx logs no upstream timeout."""
    require(nginx_binary() is not None, "nginx not installed")
    body = {**CHAT, "model": MODEL, "stream": True}
    with Nginx(front(job), tmp_path / "nginx") as proxy:
        for _ in range(2):
            chat = f"{proxy.url}/v1/chat/completions"
            with httpx.stream("POST", chat, json=body, timeout=WAIT_S) as response:
                assert response.status_code == 200
                got = events(response.iter_lines())
            assert got[-1] == "[DONE]"
            assert any(isinstance(e, dict) and e["choices"][0]["finish_reason"] for e in got)
        log = proxy.output()
    assert "timed out" not in log, log
    assert "prematurely closed" not in log, log


def test_a_stream_through_haproxy_ends_at_its_last_event(job: kit.LocalJob, tmp_path: Path) -> None:
    """HAProxy as tests/bench/frontcost.py runs it (HTTP/1.1 kept alive to the front,
    ``option http-no-delay``) passes streamed chats whole, twice on its kept connection."""
    require(haproxy_binary() is not None, "haproxy not installed")
    body = {**CHAT, "model": MODEL, "stream": True}
    with HAProxy(front(job), tmp_path / "haproxy") as proxy, httpx.Client(timeout=WAIT_S) as c:
        for _ in range(2):
            with c.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                got = events(response.iter_lines())
            assert got[-1] == "[DONE]"
            assert any(isinstance(e, dict) and e["choices"][0]["finish_reason"] for e in got)


def test_an_http10_client_gets_the_whole_stream_and_the_close(job: kit.LocalJob) -> None:
    """HTTP/1.0 straight at the front: the stream, then the front's close (no chunked end)."""
    body = json.dumps({**CHAT, "model": MODEL, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    reply = exchange(port_of(job, "prefill-0", "front"), request)  # returns once closed
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert reply.rstrip().endswith(b"data: [DONE]"), reply[-300:]


def test_bad_headers_and_bodies_get_400_on_every_server(job: kit.LocalJob) -> None:
    """A Latin-1 header value on every route of the front, two agents and both stand-ins: 400;
    JSON nested 100000 deep on their POST routes: never a 500, 400 where a body is read."""
    servers = {
        "front": (port_of(job, "prefill-0", "front"), list(front_app().routes)),
        "prefill-0 agent": (port_of(job, "prefill-0", "agent"), list(endpoint_app().routes)),
        "decode-0 agent": (port_of(job, "decode-0", "agent"), list(endpoint_app().routes)),
        "prefill stand-in": (port_of(job, "prefill-0", "http"), PREFILL_ROUTES),
        "decode stand-in": (port_of(job, "decode-0", "http"), DECODE_ROUTES),
    }
    with httpx.Client(timeout=WAIT_S) as client:
        for server, (port, routes) in servers.items():
            for method, path in routes:
                url = f"http://127.0.0.1:{port}{path}"
                r = client.request(method, url, headers={b"x-name": LATIN1})
                assert r.status_code == 400, (server, method, path, r.text)
                assert "'x-name' is not UTF-8" in r.text
                if method == "POST":
                    r = client.request(method, url, content=NESTED)  # no token: /leave is 401
                    assert 400 <= r.status_code < 500, (server, method, path, r.text)
    assert job.status()["state"] == "ready"
