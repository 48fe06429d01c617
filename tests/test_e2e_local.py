"""End to end, ``tilert-submit --local --mock`` with the REAL TileRT router (GitHub "Cluster bring-up").

One demo job (1 prefill + 2 decode) is brought up once and reused by the tests below in file order
(bring-up contract, chat, gate latency, an engine SIGKILL, the status command), and the last one
stops it and checks that nothing is left. The fault scenarios each run a job of their own.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests import e2ekit as kit

pytestmark = pytest.mark.router

READY_S = 60.0  # generous: 2 shared cores, the real router imports transformers


@pytest.fixture(scope="module")
def demo(router_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.LocalJob]:
    """The demo recipe running locally, ready."""
    root = tmp_path_factory.mktemp("e2e-local")
    sets, _ = kit.e2e_sets(router_python)
    with kit.LocalJob(root / "job", kit.DEMO_RECIPE, sets) as job:
        kit.wait_state(job.job, ("ready",), READY_S)
        yield job


def test_ready_contract(demo: kit.LocalJob) -> None:
    """status.json ready with router_url and DESIGN.md's fields; targets.json lists every agent."""
    status = kit.read_status(demo.job)
    assert status is not None
    assert status["state"] == "ready" and status["error"] is None
    assert status["router_url"].startswith("http://127.0.0.1:")
    assert status["model"] == "demo-model"
    assert status["slurm_job_id"] is None
    assert status["local_pid"] == demo.proc.pid
    names = [a["name"] for a in status["agents"]]
    assert names == ["prefill-0", "decode-0", "decode-1"]
    for entry in status["agents"]:
        assert set(entry) >= kit.AGENT_FIELDS, entry
        assert entry["state"] == "healthy", entry
        assert entry["node"] and entry["status_url"] and entry["metrics_url"]
        assert Path(entry["log"]).is_file(), entry
    targets = kit.json.loads((demo.job / "prometheus" / "targets.json").read_text())
    by_agent = {t["labels"]["agent"]: t for t in targets}
    assert sorted(by_agent) == sorted(names)
    for entry in status["agents"]:
        target = by_agent[entry["name"]]
        assert set(target["labels"]) == {"agent"}, target  # no role/node/slurm_job_id
        assert target["targets"] == [entry["metrics_url"].split("//")[1].split("/")[0]]
    # The real router, not the stand-in.
    router_log = (demo.job / "logs" / "prefill-0" / "router.log").read_text()
    assert "tilert.pd_vllm.pd_router" in router_log.splitlines()[0]
    assert "agent.standins.router" not in router_log
    assert "using the router stand-in" not in (demo.job / "logs/prefill-0/agent.log").read_text()
    demo.wait_output("READY after", 5)


def test_chat_through_the_router(demo: kit.LocalJob) -> None:
    """A streamed chat returns the stand-ins' text; two at once use both decode nodes."""
    status = kit.read_status(demo.job)
    assert status is not None
    text = kit.chat(status["router_url"], "demo-model")
    assert text == kit.ANSWER, text
    texts = kit.chat_concurrently(status["router_url"], "demo-model", 2)
    assert texts == [kit.ANSWER] * 2, texts


def test_gate_latency_reported(demo: kit.LocalJob) -> None:
    """The head logs the gate latency and exports it; printed, bounded only by the budget."""
    log = (demo.job / "logs" / "prefill-0" / "agent.log").read_text()
    line = next(x for x in log.splitlines() if "router started" in x)
    status = kit.read_status(demo.job)
    assert status is not None
    prefill = kit.agent_entry(status, "prefill-0")
    gate = kit.metric_value(prefill["metrics_url"], "tilert_agent_gate_latency_seconds")
    print(f"\nlocal gate latency: metric {gate} s; log: {line.split('head: ', 1)[-1]}")
    assert gate is not None and 0 <= gate < 60


def test_decode_engine_sigkill_recovers_on_same_ports(demo: kit.LocalJob) -> None:
    """SIGKILL decode-0's engine: same ports, degraded then ready, the router not restarted."""
    status = kit.read_status(demo.job)
    assert status is not None
    d0 = kit.agent_entry(status, "decode-0")
    before = kit.agent_status(d0["status_url"])
    record_before = kit.record(demo.job, "decode-0")
    head = kit.agent_status(kit.agent_entry(status, "prefill-0")["status_url"])
    router_pid, router_restarts = head["router"]["pid"], head["router"]["restarts"]
    assert before["state"] == "healthy" and before["pid"]
    assert psutil.Process(before["pid"]).cmdline()[2] == "agent.standins.decode"

    seen: list[str] = []
    psutil.Process(before["pid"]).send_signal(signal.SIGKILL)
    kit.wait_state(demo.job, "degraded", 15, seen=seen)
    after_status = kit.wait_state(demo.job, "ready", 30, seen=seen)
    print(f"\nstates after the SIGKILL: {seen}")

    after = kit.agent_status(d0["status_url"])
    assert after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1
    assert after["ports"] == before["ports"]
    assert kit.record(demo.job, "decode-0")["ports"] == record_before["ports"]
    assert kit.agent_entry(after_status, "decode-0")["restarts"] == after["restarts"]
    head = kit.agent_status(kit.agent_entry(after_status, "prefill-0")["status_url"])
    assert head["router"]["pid"] == router_pid
    assert head["router"]["restarts"] == router_restarts == 0
    texts = kit.chat_concurrently(after_status["router_url"], "demo-model", 2)
    assert texts == [kit.ANSWER] * 2, texts


def test_status_command(demo: kit.LocalJob) -> None:
    """``tilert-submit status J`` and ``--json`` read the running job."""
    done = kit.submit_cmd("status", str(demo.job))
    assert done.returncode == 0, done.stderr
    assert "job: ready" in done.stdout and "decode-1" in done.stdout
    assert "STALE" not in done.stdout
    done = kit.submit_cmd("status", str(demo.job), "--json")
    assert done.returncode == 0, done.stderr
    view = kit.json.loads(done.stdout)
    assert view["stale"] is False and view["status"]["state"] == "ready"


def test_stop_leaves_nothing(demo: kit.LocalJob) -> None:
    """``tilert-submit stop J``: every process gone within the graces, status.json ``stopped``."""
    ports = kit.job_ports(demo.job)
    procs = kit.job_processes(demo.job, ports)
    assert len(procs) >= 7, kit.describe(procs)  # submit, 3 agents, 3 engines, the router
    done = kit.submit_cmd("stop", str(demo.job), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGKILL" not in done.stdout, done.stdout  # the supervisor exited by itself
    assert demo.wait_exit(30) == 0, demo.output()
    left = kit.wait_gone(procs, 5)
    assert not left, "left behind:\n" + kit.describe(left)
    assert not kit.job_processes(demo.job, ports)
    status = kit.read_status(demo.job)
    assert status is not None and status["state"] == "stopped", status
    assert status["router_url"] is None
    # A stopped job: stop again is fine, status still reads it; a stale "ready" is called so.
    assert kit.submit_cmd("stop", str(demo.job)).returncode == 0
    stale = dict(status, state="ready")
    (demo.job / "status.json").write_text(kit.json.dumps(stale))
    done = kit.submit_cmd("status", str(demo.job), "--json")
    assert done.returncode == 0
    assert kit.json.loads(done.stdout)["stale"] is True, done.stdout


# ---- faults, each its own job --------------------------------------------------------------


def test_decode_crash_loop_is_dropped(router_python: Path, tmp_path: Path) -> None:
    """decode-1 in a crash loop: dropped, the job keeps serving degraded through decode-0."""
    sets, _ = kit.e2e_sets(
        router_python,
        "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
        "roles.decode.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
        "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 2, window_s: 60}",
    )
    with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
        status = kit.wait_status(
            job.job,
            lambda s: (
                s["state"] == "degraded"
                and kit.agent_entry(s, "decode-1")["state"] == "failed"
                and "dropped" in kit.agent_entry(s, "decode-1")["reason"]
                and s["router_url"] is not None
                and kit.router_serves_without(job.job, s, "decode-1")
            ),
            "degraded with decode-1 dropped and the router healthy without it",
            READY_S,
        )
        d1 = kit.agent_entry(status, "decode-1")
        assert d1["log"].endswith("logs/decode-1/engine.log") and Path(d1["log"]).is_file()
        assert "restart" in d1["reason"] or "exited" in d1["reason"], d1
        assert kit.agent_entry(status, "decode-0")["state"] == "healthy"
        assert kit.chat(status["router_url"], "demo-model") == kit.ANSWER
        # Still serving a moment later (the job does not fail with one decode left).
        status = kit.wait_state(job.job, "degraded", 5)
        assert kit.chat(status["router_url"], "demo-model") == kit.ANSWER
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()
        assert kit.wait_state(job.job, "stopped", 5)


def test_prefill_crash_loop_fails_the_job(router_python: Path, tmp_path: Path) -> None:
    """The prefill crash-looping: failed, naming prefill-0, its reason and log; exit 1."""
    sets, _ = kit.e2e_sets(
        router_python,
        "roles.prefill.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
        "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 1, window_s: 60}",
    )
    with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
        assert job.wait_exit(READY_S) == 1, job.output()
        status = kit.read_status(job.job)
        assert status is not None and status["state"] == "failed", status
        assert "prefill-0" in status["error"], status["error"]
        assert "logs/prefill-0/engine.log" in status["error"], status["error"]
        assert kit.agent_entry(status, "prefill-0")["state"] == "failed"
        assert "job failed" in job.output()
        assert "exiting with code 1" in (job.job / "logs/prefill-0/agent.log").read_text()
        assert not kit.wait_gone(kit.job_processes(job.job, kit.job_ports(job.job)), 10)


def test_workers_never_healthy_fail_the_job(router_python: Path, tmp_path: Path) -> None:
    """Decodes that never answer within a small startup budget: failed, naming them."""
    sets, _ = kit.e2e_sets(
        router_python,
        # Bound and hanging (not a startup delay, whose unbound ports another job could take).
        "roles.decode.env.TILERT_MOCK_HANG_HEALTH=1",
        "agent.startup_budget_s={prefill: 3, decode: 3, router: 60}",
    )
    with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
        assert job.wait_exit(READY_S) == 1, job.output()
        status = kit.read_status(job.job)
        assert status is not None and status["state"] == "failed", status
        for name in ("decode-0", "decode-1"):
            assert name in status["error"], status["error"]
            assert f"logs/{name}/engine.log" in status["error"], status["error"]
        assert "startup" in status["error"], status["error"]
        assert not kit.wait_gone(kit.job_processes(job.job, kit.job_ports(job.job)), 10)


def test_router_port_taken_fails_at_once(router_python: Path, tmp_path: Path) -> None:
    """The router's fixed port taken: the head says so, tilert-submit exits 1 (not hangs)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        sets = [
            "--set",
            f"agent.router_python={router_python}",
            "--set",
            f"agent.router_port={port}",
        ]
        with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
            assert job.wait_exit(30) == 1, job.output()
            status = kit.read_status(job.job)
            assert status is not None and status["state"] == "failed", status
            assert f"router port {port} is taken" in status["error"], status["error"]
            assert not kit.wait_gone(kit.job_processes(job.job, kit.job_ports(job.job)), 10)


def test_submit_exits_on_sigint_before_ready(router_python: Path, tmp_path: Path) -> None:
    """Ctrl-C while waiting: every agent stops and tilert-submit exits 0."""
    sets, _ = kit.e2e_sets(router_python, "roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S=30")
    with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
        kit.wait_state(job.job, "waiting", READY_S)
        procs = kit.job_processes(job.job, kit.job_ports(job.job))
        job.proc.send_signal(signal.SIGINT)
        assert job.wait_exit(30) == 0, job.output()
        assert not kit.wait_gone(procs, 5)


def test_supervisor_sigkill_takes_everything_along(router_python: Path, tmp_path: Path) -> None:
    """SIGKILL to tilert-submit --local alone: its agents and their engines die with it."""
    sets, _ = kit.e2e_sets(router_python, "roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S=30")
    with kit.LocalJob(tmp_path / "job", kit.DEMO_RECIPE, sets) as job:
        kit.wait_status(
            job.job,
            lambda s: kit.agent_entry(s, "prefill-0")["state"] == "healthy",
            "with prefill-0 healthy",
            READY_S,
        )
        procs = kit.job_processes(job.job, kit.job_ports(job.job))
        assert len(procs) >= 6, kit.describe(procs)  # submit, 3 agents, 3 engines
        job.proc.send_signal(signal.SIGKILL)
        job.wait_exit(5)
        left = kit.wait_gone(procs, 5)
        assert not left, "left behind:\n" + kit.describe(left)
