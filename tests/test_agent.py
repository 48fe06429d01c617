"""``tilert-agent`` as a real process on 127.0.0.1: record, /status, restarts, stops, faults,
endpoint.

Every agent runs on a job directory made by ``tilert-submit recipes/local-demo.yaml --mock
--dry-run`` (``make_job``, tests/kit/jobs.py), with the stand-in decode as its engine and fault
switches set through ``--set roles.decode.env.TILERT_MOCK_...``. The read-only endpoint tests share
one healthy agent (``steady``: started again after a test that killed it or failed); the others
start their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
import psutil
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.node.identity import resolve_identity
from agent.node.rendezvous import read_records
from agent.nodeagent import NodeAgent
from tests.kit import (
    AGENT,
    REPO,
    AgentProc,
    Agents,
    LongPoll,
    Shared,
    clean_env,
    make_job,
    running_agents,
    still_alive,
    wait_for,
)

# docs/agent.md's /status (with the long-poll ``version``); prefill-0 adds router.
STATUS_FIELDS = {
    "name",
    "role",
    "index",
    "node",
    "state",
    "pid",
    "ports",
    "restarts",
    "reason",
    "since",
    "uptime_s",
    "version",
    "healthy_at",
    "progress",
    "progress_at",
}
RECORD_FIELDS = {
    "schema",
    "name",
    "role",
    "index",
    "node",
    "address",
    "ports",
    "status_url",
    "metrics_url",
    "versions",
    "updated_at",
    "slurm_job_id",
}
MOCK = "roles.decode.env.TILERT_MOCK_"


@pytest.fixture
def agents() -> Iterator[Agents]:
    """Agents of one test, killed (with their engines) afterwards."""
    with running_agents() as started:
        yield started


@pytest.fixture(scope="module")
def shared_steady(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared[AgentProc]]:
    """A decode-0 agent the read-only endpoint tests of this module share."""

    @contextlib.contextmanager
    def start() -> Iterator[AgentProc]:
        job = make_job(tmp_path_factory.mktemp("steady"))
        with running_agents() as started:
            yield started.start(job, "decode", 0)

    with Shared(
        start, prepare=lambda agent: agent.wait_state("healthy"), ended=AgentProc.ended
    ) as shared:
        yield shared


@pytest.fixture
def steady(shared_steady: Shared[AgentProc], request: pytest.FixtureRequest) -> Iterator[AgentProc]:
    """The shared decode-0 agent, healthy."""
    yield from shared_steady.borrow(request)


@pytest.fixture
def steady_to_kill(shared_steady: Shared[AgentProc]) -> Iterator[AgentProc]:
    """The shared decode-0 agent, healthy, for a test that kills it (the next starts another)."""
    yield from shared_steady.consume()


def engine_of(status: dict[str, Any]) -> psutil.Process:
    """The process /status names as the engine."""
    assert isinstance(status["pid"], int), status
    return psutil.Process(status["pid"])


def agent_log(agent: AgentProc) -> str:
    """The agent's agent.log now."""
    return agent.agent_log.read_text(errors="replace")


# ---- the contract, on one steady agent -----------------------------------------------------


def test_record_and_status_contract(steady: AgentProc) -> None:
    record = steady.wait_record()
    assert set(record) == RECORD_FIELDS
    assert (record["schema"], record["name"], record["role"], record["index"]) == (
        1,
        "decode-0",
        "decode",
        0,
    )
    assert record["address"] == "127.0.0.1"
    assert set(record["ports"]) == {"http", "ctrl", "agent"}
    agent_port = record["ports"]["agent"]
    assert record["status_url"] == f"http://127.0.0.1:{agent_port}/status"
    assert record["metrics_url"] == f"http://127.0.0.1:{agent_port}/metrics"
    assert httpx.get(record["status_url"], timeout=5).status_code == 200

    status = steady.status()
    assert set(status) == STATUS_FIELDS, f"extra/missing: {set(status) ^ STATUS_FIELDS}"
    assert (status["name"], status["role"], status["index"]) == ("decode-0", "decode", 0)
    assert status["node"] == record["node"]
    assert status["state"] == "healthy"
    assert status["restarts"] == 0
    assert status["reason"]
    assert status["since"] <= time.time()
    assert status["healthy_at"] <= status["since"]  # the answer that made it healthy
    assert status["uptime_s"] > 0
    assert status["ports"] == {k: v for k, v in record["ports"].items()}

    # pid is the engine's own leader: the decode stand-in, in its own process group, our child.
    engine = engine_of(status)
    cmdline = engine.cmdline()
    assert "agent.standins.decode" in cmdline, cmdline
    assert cmdline[cmdline.index("--http-port") + 1] == str(record["ports"]["http"])
    assert cmdline[cmdline.index("--ctrl-port") + 1] == str(record["ports"]["ctrl"])
    assert os.getpgid(engine.pid) == engine.pid
    assert os.getpgid(engine.pid) != os.getpgid(steady.pid)
    assert engine.ppid() == steady.pid
    health = httpx.get(f"http://127.0.0.1:{record['ports']['http']}/health", timeout=5)
    assert health.status_code == 200


def test_long_poll_answers_after_timeout_without_change(steady: AgentProc) -> None:
    version = steady.status()["version"]
    t0 = time.monotonic()
    response = httpx.get(steady.url(f"/status?after={version}&timeout=1"), timeout=10)
    elapsed = time.monotonic() - t0
    assert response.status_code == 200
    assert response.json()["version"] == version
    assert 0.9 <= elapsed < 5, elapsed
    # A version already passed answers at once.
    t0 = time.monotonic()
    response = httpx.get(steady.url(f"/status?after={version - 1}&timeout=20"), timeout=30)
    assert response.json()["version"] == version
    assert time.monotonic() - t0 < 5


def test_status_query_values_that_are_not_numbers_are_400(steady: AgentProc) -> None:
    base = steady.url("/status")
    for query in (
        "after=nan",
        "after=inf",
        "after=-inf",
        "after=1.5",
        "after=x",
        "after=" + "9" * 40,
        "after=0&timeout=nan",
        "after=0&timeout=inf",
        "after=0&timeout=-1",
        "after=0&timeout=1e999",
        "after=0&timeout=soon",
    ):
        response = httpx.get(f"{base}?{query}", timeout=5)
        assert response.status_code == 400, (query, response.status_code, response.text)
        assert "query parameter" in response.text, response.text
    # A huge timeout is cut to the maximum; after=-1 asks for the status at once.
    response = httpx.get(f"{base}?after=-1&timeout=1e9", timeout=5)
    assert response.status_code == 200
    assert response.json()["name"] == "decode-0"


def test_metrics_carry_role_node_and_job_labels(steady: AgentProc) -> None:
    node = steady.status()["node"]
    response = httpx.get(steady.url("/metrics"), timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = [
        s
        for family in text_string_to_metric_families(response.text)
        if family.name.startswith("tilert_agent_")
        for s in family.samples
    ]
    assert samples, response.text[:500]
    for sample in samples:
        assert sample.labels.get("role") == "decode", sample
        assert sample.labels.get("node") == node, sample
        assert "slurm_job_id" in sample.labels, sample
    up = [s for s in samples if s.name == "tilert_agent_engine_up"]
    assert [s.value for s in up] == [1.0], up


def test_logs_need_the_bearer_token(steady: AgentProc) -> None:
    token = (steady.job / "token").read_text().strip()
    url = steady.url("/logs?name=engine&tail=50")
    assert httpx.get(url, timeout=5).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 401
    assert token not in wrong.text
    auth = {"Authorization": f"Bearer {token}"}
    engine = httpx.get(url, headers=auth, timeout=5)
    assert engine.status_code == 200
    assert "generation 1 started" in engine.text
    agent = httpx.get(steady.url("/logs?name=agent"), headers=auth, timeout=5)
    assert agent.status_code == 200
    assert "healthy" in agent.text
    for name in ("router", "../token", "nope"):  # decode-0 has no router log
        assert (
            httpx.get(steady.url(f"/logs?name={name}"), headers=auth, timeout=5).status_code == 404
        )


def test_sigkill_of_agent_long_after_spawn_takes_the_engine(steady_to_kill: AgentProc) -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* exits; trio's worker threads retire after
    # 10 s idle. An engine forked from one would die 10 s after spawn; one that survives that
    # must still die with its agent. (The shared agent's engine is usually that old already.)
    steady = steady_to_kill
    engine = engine_of(steady.status())
    age = time.time() - engine.create_time()
    if age < 10.5:
        time.sleep(10.5 - age)  # the scenario is the engine's age, not an event to wait for
    assert engine.is_running(), "the engine died on its own >10 s after spawn (PDEATHSIG trap)"
    tree = steady.remember_tree()
    assert engine in tree, tree
    assert len(tree) >= 3, tree  # agent, engine, lifeline watcher
    os.kill(steady.pid, signal.SIGKILL)
    assert not still_alive(tree[1:], 1.0), "engine tree outlived a SIGKILLed agent by >1 s"


# ---- lifecycles, each on its own job ---------------------------------------------------------


def test_engine_killed_restarts_on_same_ports_then_sigterm_stops_all(
    tmp_path: Path, agents: Agents
) -> None:
    job = make_job(tmp_path)
    agent = agents.start(job)
    first = agent.wait_state("healthy")
    record = agent.wait_record()
    old_engine = engine_of(first)

    # A long poll from before the kill (the agent has read it: it holds it) answers promptly
    # with the change.
    poll = LongPoll(record["ports"]["agent"], first["version"], timeout_s=30)
    wait_for("the agent to read the long poll", poll.read_by_agent, 10)
    old_engine.kill()
    answered, elapsed = poll.answer()
    assert answered, "long poll did not answer"
    assert answered["version"] > first["version"]
    assert elapsed < 10, (elapsed, answered)

    again = agent.wait_status(
        "healthy again after the engine's SIGKILL",
        lambda s: s["state"] == "healthy" and s["restarts"] >= 1,
    )
    assert again["pid"] != first["pid"]
    assert again["ports"] == first["ports"], "ports must be sticky once healthy"
    assert agent.wait_record()["ports"] == record["ports"]
    assert "killed by signal 9" in agent_log(agent)

    tree = agent.remember_tree()
    assert engine_of(again) in tree
    agent.signal(signal.SIGTERM)
    assert agent.wait(2 + 5) == 0  # stop grace 2 s (kit.FAST) + slack
    assert not still_alive(tree, 1.0)
    assert "stopped on request" in agent_log(agent)
    last = agent.record()
    assert last is not None
    assert last["ports"] == record["ports"], last
    assert (last["exited"]["state"], last["exited"]["code"]) == ("stopped", 0), last


async def test_an_agent_that_crashes_leaves_its_last_word(tmp_path: Path) -> None:
    """An unexpected error ends the agent with exit 1, logged with its traceback, and its record
    says ``exited: failed`` with the error (the head takes it as failed at once)."""
    job = JobDir(make_job(tmp_path))
    plan = load_plan(job.plan.read_bytes())
    log = logging.getLogger("test_agent.crash")
    agent = NodeAgent(job=job, plan=plan, identity=resolve_identity("decode", 1, "lo"), log=log)

    async def broken(spec: object) -> NoReturn:  # noqa: ARG001 (the launcher's signature)
        raise RuntimeError("launcher bug\nsecond line")

    agent.launcher.start = broken  # type: ignore[method-assign]
    with trio.fail_after(30):
        assert await agent.run() == 1
    record = read_records(job, {"decode-1"}).by_name["decode-1"]
    assert record.exited is not None
    assert (record.exited.state, record.exited.code) == ("failed", 1)
    assert record.exited.reason == "agent crashed: RuntimeError: launcher bug\\nsecond line"
    assert record.ports
    assert record.status_url


def test_sigkill_of_agent_takes_the_engine_at_once(tmp_path: Path, agents: Agents) -> None:
    agent = agents.start(make_job(tmp_path))
    engine = engine_of(agent.wait_state("healthy"))
    tree = agent.remember_tree()
    assert engine in tree
    os.kill(agent.pid, signal.SIGKILL)
    assert not still_alive([p for p in tree if p.pid != agent.pid], 1.0)


def test_crash_loop_fails_naming_the_limit_and_showing_engine_lines(
    tmp_path: Path, agents: Agents
) -> None:
    job = make_job(
        tmp_path,
        f"{MOCK}CRASH_AFTER_S=0.4",
        "agent.restart.max_restarts=2",
    )
    agent = agents.start(job)
    failed = agent.wait_state("failed", timeout=30)
    assert "max_restarts" in failed["reason"], failed["reason"]
    assert failed["restarts"] == 2
    # A failed worker stays up to say so (the head drops it from the router on that answer);
    # when it is stopped it exits 1: its engine failed. A long poll for 0.3 s answers early on
    # any change, so this sees it still failed after that or the state it changed to.
    version = agent.status()["version"]
    later = httpx.get(agent.url(f"/status?after={version}&timeout=0.3"), timeout=10)
    assert later.json()["state"] == "failed"
    agent.signal(signal.SIGTERM)
    assert agent.wait(10) == 1
    log = agent_log(agent)
    assert "--- last" in log
    assert "stand-in fault: crashing after" in log.split("--- last", 1)[1], log[-2000:]


def test_engine_exit_zero_is_a_failure_and_restarted(tmp_path: Path, agents: Agents) -> None:
    job = make_job(tmp_path, f"{MOCK}CRASH_AFTER_S=0.6", f"{MOCK}EXIT_CODE=0")
    agent = agents.start(job)
    wait_for("an exit 0 in agent.log", lambda: "exited with code 0" in agent_log(agent), 20)
    agent.wait_status("restarted after an exit 0", lambda s: s["restarts"] >= 1, timeout=20)
    engine_log = (job / "logs" / "decode-0" / "engine.log").read_text()
    assert "EngineDeadError" in engine_log


def test_startup_budget_exceeded_fails_naming_the_budget(tmp_path: Path, agents: Agents) -> None:
    # The stand-in's first line ("loading TileRT engine") is progress: a short silence bound
    # keeps the deadline near the budget (docs/agent.md "Startup deadlines that watch progress").
    job = make_job(
        tmp_path,
        f"{MOCK}STARTUP_DELAY_S=20",
        "agent.startup_budget_s.decode=1",
        "agent.startup_silence_s=1",
    )
    agent = agents.start(job)
    tree_seen: list[psutil.Process] = []

    def failed_yet(status: dict[str, Any]) -> bool:
        tree_seen.extend(agent.tree())  # the loading engine, to check it is gone afterwards
        state: str = status["state"]
        return state == "failed"

    failed = agent.wait_status("failed", failed_yet, 15)
    assert "startup budget" in failed["reason"], failed["reason"]
    assert "startup budget of 1s" in failed["reason"], failed["reason"]
    assert "agent.startup_budget_s" in failed["reason"]
    engines = [p for p in tree_seen if p.pid != agent.pid]
    assert engines, "the loading engine outlived its budget"
    assert not still_alive(engines, 3.0), "the loading engine outlived its budget"
    agent.signal(signal.SIGTERM)
    assert agent.wait(10) == 1


def test_hung_health_after_healthy_restarts(tmp_path: Path, agents: Agents) -> None:
    # A stopped (SIGSTOP) engine accepts connections in the kernel and never answers: a hang.
    job = make_job(tmp_path, "agent.probe.timeout_s=0.3", "agent.probe.failure_threshold=2")
    agent = agents.start(job)
    first = agent.wait_state("healthy")
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        again = agent.wait_status(
            "healthy again after a hung /health",
            lambda s: s["state"] == "healthy" and s["restarts"] >= 1,
            timeout=20,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first["pid"], signal.SIGCONT)
    assert again["pid"] != first["pid"]
    log = agent_log(agent)
    assert "-> unhealthy: 2 consecutive health probe failures" in log, log[-2000:]


def hold_port(port: int) -> list[socket.socket]:
    """Bind ``port`` on 0.0.0.0 and on :: (v6only), listening, as another server would."""
    held = []
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        sock = socket.socket(family, socket.SOCK_STREAM)
        # As real servers do: the port may still have TIME_WAIT entries from an earlier test.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen()
        held.append(sock)
    return held


def test_port_taken_before_engine_binds_moves_ports(tmp_path: Path, agents: Agents) -> None:
    job = make_job(tmp_path, f"{MOCK}STARTUP_DELAY_S=2")
    agent = agents.start(job)
    record = agent.wait_record()
    http = record["ports"]["http"]
    held = hold_port(http)
    try:
        healthy = agent.wait_state("healthy", timeout=20)
        assert healthy["ports"]["http"] != http
        moved = agent.wait_record()
        assert moved["ports"] == healthy["ports"]
        assert moved["updated_at"] > record["updated_at"]
        assert healthy["restarts"] == 0, "a port lost before the first healthy is not a crash"
        engine = engine_of(healthy)
        assert str(healthy["ports"]["http"]) in engine.cmdline()
        assert "engine port taken before it bound" in agent_log(agent)
    finally:
        for sock in held:
            sock.close()


# ---- bad input: exit 2 with a message ----------------------------------------------------------


def run_agent(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``tilert-agent --role decode --job-dir JOB ARGS`` to its end."""
    argv = [*AGENT, "--role", "decode", "--job-dir", str(job), *args]
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, env=clean_env(), timeout=30
    )


def test_missing_plan_exits_2(tmp_path: Path) -> None:
    done = run_agent(tmp_path)
    assert done.returncode == 2
    assert "no plan.json" in done.stderr
    assert "tilert-submit" in done.stderr
    assert "Traceback" not in done.stderr


def test_corrupt_plan_exits_2(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    (job / "plan.json").write_text('{"schema": 1, "name": ')
    done = run_agent(job)
    assert done.returncode == 2
    assert "plan.json" in done.stderr
    assert "unusable plan" in done.stderr
    assert "Traceback" not in done.stderr


def test_index_beyond_the_plan_exits_2(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    done = run_agent(job, "--index", "2")  # the demo has decode-0 and decode-1
    assert done.returncode == 2
    assert "index 2" in done.stderr
    assert "2 decode worker" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (job / "rendezvous" / "decode-2.json").exists()


def test_wait_for_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="the impossible"):
        wait_for("the impossible", lambda: False, 0.1)
