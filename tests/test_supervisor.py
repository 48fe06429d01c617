"""``EngineSupervisor`` on real tiny engines (python -c scripts) through the process launcher.

What needs a real process: its output, signals, a foreign process on our port. The restart
policy (backoff, give up, a stop during the backoff) runs on scripted engines in
tests/test_supervisor_policy.py."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
from pathlib import Path

import httpx
import trio

from agent.launch import LaunchSpec, ProcessLauncher
from agent.node.logpump import LogSink
from agent.node.supervisor import EngineSupervisor, Policy
from tests import kit
from tests.infra.ports import free_port

PY = sys.executable
ENV = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONUNBUFFERED": "1"}

# An engine serving /health 200 on $PORT (ignores SIGTERM when $STUBBORN is set).
SERVE = textwrap.dedent(
    """
    import http.server, os, signal
    if os.environ.get("STUBBORN"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)


def policy(**changes: float) -> Policy:
    """A fast policy; ``changes`` override fields."""
    values = dict(
        probe_startup_interval_s=0.02,
        probe_interval_s=0.05,
        probe_timeout_s=0.5,
        probe_failure_threshold=2,
        restart_backoff_initial_s=0.1,
        restart_backoff_max_s=0.4,
        restart_max=3,
        restart_window_s=60.0,
        startup_budget_s=10.0,
        stop_grace_s=1.0,
    )
    values.update(changes)
    return Policy(**values)  # type: ignore[arg-type]


class Harness:
    """A supervisor of ``python -c SCRIPT`` with a log sink in ``tmp``; records what it saw."""

    def __init__(
        self,
        tmp: Path,
        script: str,
        pol: Policy,
        client: httpx.AsyncClient | None = None,
        **env: str,
    ) -> None:
        self.port = free_port()
        self.generations = 0
        self.moves = 0
        self.states: list[str] = []
        self.log = logging.getLogger(f"test-supervisor-{id(self)}")
        self.sup = EngineSupervisor(
            name="engine",
            launcher=ProcessLauncher(),
            build=self._build,
            health_url=lambda: f"http://127.0.0.1:{self.port}/health",
            ports=lambda: {"http": self.port},
            policy=pol,
            sink=LogSink(tmp / "engine.log", max_bytes=1 << 20, backups=0),
            log=self.log,
            on_change=lambda: self.states.append(self.sup.state),
            on_address_in_use=self._moved,
            client=client,
        )
        self.script = script
        self.env = {**ENV, **env}

    def _build(self) -> LaunchSpec:
        self.generations += 1
        env = {**self.env, "PORT": str(self.port), "GEN": str(self.generations)}
        return LaunchSpec(name="engine", argv=[PY, "-c", self.script], env=env)

    def _moved(self) -> None:
        self.moves += 1
        self.port = free_port()


async def test_address_in_use_moves_ports_once_then_counts_crashes(tmp_path: Path) -> None:
    # Generation 1 loses its port; later ones die of something else. The old "address in use"
    # line is still among the last lines: it must not make every later death a free relaunch.
    script = textwrap.dedent(
        """
        import os, sys
        if os.environ["GEN"] == "1":
            # Spelled in two parts: the script's own text is in the generation's start note.
            print("OSError: Address already " + "in use", flush=True)
        else:
            print("RuntimeError: weights are corrupt", flush=True)
        sys.exit(1)
        """
    )
    h = Harness(tmp_path, script, policy(restart_max=2, restart_backoff_initial_s=0.02))
    with trio.fail_after(15):
        await h.sup.run()
    assert h.moves == 1
    assert h.sup.state == "failed"
    assert "max_restarts" in h.sup.reason
    assert h.generations == 4  # 1 moved + 1 first crash + 2 restarts
    assert h.sup.restarts == 2


async def test_stop_sigterms_then_sigkills_after_grace(tmp_path: Path) -> None:
    h = Harness(tmp_path, SERVE, policy(stop_grace_s=0.5), STUBBORN="1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.sup.run)
        await kit.until(lambda: h.sup.state == "healthy", "the engine healthy")
        pid = h.sup.status().pid
        assert pid is not None
        t0 = time.monotonic()
        with trio.fail_after(10):
            await h.sup.stop()
        took = time.monotonic() - t0
    assert 0.4 <= took < 5, took
    assert h.sup.state == "stopped"
    assert h.states[-2:] == ["stopping", "stopped"]
    assert h.sup.status().pid is None
    assert h.sup.process is not None
    assert h.sup.process.returncode == -9


async def test_probes_use_the_agents_client_and_healthy_at_is_the_answers_time(
    tmp_path: Path,
) -> None:
    # The router's supervisor starts right after the gate: building a client there (an SSL
    # context, ~25 ms) delayed the router. healthy_at is where the head's gate figure starts.
    probed: list[str] = []

    class Seen(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            probed.append(request.url.path)
            return await super().handle_async_request(request)

    async with httpx.AsyncClient(transport=Seen()) as client:
        h = Harness(tmp_path, SERVE, policy(), client=client)
        launched = time.time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.sup.run)
            await kit.until(lambda: h.sup.state == "healthy", "the engine healthy")
            healthy = h.sup.status()
            await h.sup.stop()
    assert probed
    assert set(probed) == {"/health"}
    assert healthy.healthy_at is not None
    assert launched < healthy.healthy_at <= healthy.since
    assert h.sup.status().healthy_at is None  # stopped: no longer healthy


async def test_a_foreign_answer_on_our_port_is_not_our_engine(tmp_path: Path) -> None:
    """Another process serves /health on the probed port while our engine loads: new ports."""
    # Our engine loads slowly and then serves on $PORT.
    slow = "import time; time.sleep(1.0)\n" + SERVE
    h = Harness(tmp_path, slow, policy())
    foreign_port = h.port
    # The foreign server: the same tiny /health 200, but not in our engine's process tree.
    foreign = await trio.lowlevel.open_process(
        [PY, "-c", SERVE], env={**ENV, "PORT": str(foreign_port)}
    )
    try:
        await kit.until(lambda: _listening(foreign_port), "the foreign server listening")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.sup.run)
            await kit.until(lambda: h.sup.state == "healthy", "the engine healthy on new ports", 15)
            assert h.moves == 1, "the foreign answer must move the engine to new ports"
            assert h.port != foreign_port
            assert h.sup.restarts == 0  # a port move is not a crash
            await h.sup.stop()
    finally:
        foreign.kill()
        await foreign.wait()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
