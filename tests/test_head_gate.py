"""The whole ``Head`` on a demo plan with no process: the gate, the router, the canaries, the drop.

The peers' ``/status`` long polls, the router's ``/health`` and the canary chat are answered by
one ``httpx.MockTransport``; the router is a scripted engine of ``tests.kit.fakelauncher``. What
the real router and stand-ins do is in the end-to-end tests (tests/test_e2e_local.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from agent.head import Head, HeadContext
from agent.http.longpoll import ClientFetch
from agent.http.metrics import HeadFigures
from agent.job.names import HEAD_NAME
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.job.records import AgentStatus
from agent.job.vocab import EngineState
from agent.launch import LaunchSpec
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites
from agent.node.rendezvous import write_record
from tests import kit
from tests.kit.fakelauncher import Engine, FakeLauncher
from tests.test_canaries import stream
from tests.test_head import record, status

LOG = logging.getLogger("test_head_gate")
DECODES = ("decode-0", "decode-1")


@dataclass
class Peers:
    """What each decode's ``/status`` says; a change answers the held long polls at once."""

    states: dict[str, EngineState] = field(
        default_factory=lambda: dict.fromkeys(DECODES, "healthy")
    )
    changed: trio.Event = field(default_factory=trio.Event)
    healthy_at: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(DECODES, time.time())
    )
    canaries: int = 0

    def set(self, name: str, state: EngineState) -> None:
        self.states[name] = state
        self.healthy_at[name] = time.time()
        self.changed.set()
        self.changed = trio.Event()

    def answer(self, name: str) -> AgentStatus:
        """``name``'s ``/status`` now."""
        state = self.states[name]
        healthy = state == "healthy"
        answer = status(state, name, "serving" if healthy else "loading")
        return msgspec.structs.replace(
            answer, healthy_at=self.healthy_at[name] if healthy else None
        )


def transport(peers: Peers, launcher: FakeLauncher) -> httpx.MockTransport:
    """The peers' /status, the router's /health (the fake router's answer) and the canary chat."""
    health = launcher.health_transport()

    async def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/status"):
            name = path.split("/")[1]
            if request.url.params.get("after", "-1") != "-1":
                await peers.changed.wait()  # a long poll, answered by the next change
            return httpx.Response(200, content=msgspec.json.encode(peers.answer(name)))
        if path == "/v1/chat/completions":
            peers.canaries += 1
            return httpx.Response(200, content=stream("Hello"))
        return await health.handle_async_request(request)

    return httpx.MockTransport(handle)


@asynccontextmanager
async def head_of(tmp_path: Path, peers: Peers, launcher: FakeLauncher) -> AsyncIterator[Head]:
    """A ``Head`` of the demo job (1 prefill, 2 decodes) running; stopped on the way out."""
    job = JobDir(kit.make_job(tmp_path))
    plan = load_plan(job.plan.read_bytes())
    job.rendezvous.mkdir(exist_ok=True)
    for index, name in enumerate(DECODES):
        url = f"http://peers/{name}/status"
        write_record(job, msgspec.structs.replace(record(name), index=index, status_url=url))

    own = msgspec.structs.replace(status("healthy", HEAD_NAME), healthy_at=time.time() - 1)

    async def stop_node() -> None:
        await head.stop()

    async with httpx.AsyncClient(transport=transport(peers, launcher)) as client:
        ctx = HeadContext(
            plan=plan,
            job=job,
            identity=Identity("prefill", 0, "node-0", "127.0.0.1", None),
            log=LOG,
            launcher=launcher,
            launch_spec=lambda name, argv, env, image: LaunchSpec(name, argv, env, image=image),
            own_status=lambda: own,
            on_change=lambda: None,
            prefill_url=lambda: "http://127.0.0.1:8100",
            figures=HeadFigures(),
            probe_observer=lambda _component: lambda _latency: None,
            stop_node=stop_node,
            writes=JobWrites(LOG, lambda: None),
            client=client,
            peer_fetch=lambda: ClientFetch(client),
        )
        head = Head(ctx)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(head.run)
            yield head
            head.request_stop()
            await kit.until(lambda: head.state == "stopped", "the head stopped", 30)


def decodes_of(spec: LaunchSpec) -> list[str]:
    """The router's ``--decode`` specs in its argv."""
    after = spec.argv[spec.argv.index("--decode") + 1 :]
    return [a for a in after[: next((i for i, a in enumerate(after) if a.startswith("--")), None)]]


async def test_the_router_starts_only_once_every_decode_is_healthy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG.name)
    peers = Peers()
    peers.states["decode-1"] = "starting"
    launcher = FakeLauncher([Engine(healthy_after=0.0)])
    async with head_of(tmp_path, peers, launcher) as head:
        await kit.until(
            lambda: head.state == "waiting" and head.peers.state("decode-0") == "healthy",
            "the head waiting at the gate, decode-0 seen healthy",
            30,
        )
        assert launcher.started == []  # no router while a decode loads
        said = [r.getMessage() for r in caplog.records if "-> waiting" in r.getMessage()]
        assert "decode-1 (starting)" in said[0]
        peers.set("decode-1", "healthy")
        await kit.until(lambda: head.state == "ready", "the job ready", 30)
    router = launcher.started[0].spec
    assert len(launcher.started) == 1
    assert decodes_of(router) == ["10.0.0.1:8300:8200", "10.0.0.1:8300:8200"]
    assert peers.canaries == 2  # one canary per decode node before ready
    assert head.gate is not None
    assert head.gate.last_worker == "decode-1"


async def test_a_failed_decode_is_left_out_and_the_job_serves_degraded(tmp_path: Path) -> None:
    peers = Peers()
    peers.states["decode-1"] = "failed"
    launcher = FakeLauncher([Engine(healthy_after=0.0)])
    async with head_of(tmp_path, peers, launcher) as head:
        await kit.until(lambda: head.state == "degraded", "the job degraded", 30)
        assert "decode-1" in head.dropped
    assert decodes_of(launcher.started[0].spec) == ["10.0.0.1:8300:8200"]
    assert peers.canaries == 1
