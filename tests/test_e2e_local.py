"""End to end, ``tilert-submit --local --mock`` with the REAL TileRT router (GitHub "Cluster
bring-up").

The tests that need a running demo job (1 prefill + 2 decode) share one (``demo``: ready before
each test; started again after a test that stopped it or failed), so each passes alone and in any
order; the stop test gets it through ``demo_to_stop`` and ends it. The fault scenarios each run a
job of their own. The scenarios the Slurm tests share are in tests/kit/scenarios.py.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import kit

pytestmark = pytest.mark.router

READY_S = 120.0  # a bound only: a router start takes 20 s on a loaded 2-core machine


@pytest.fixture(scope="module")
def shared_demo(
    router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[kit.Shared[kit.LocalJob]]:
    """The demo recipe running locally, shared by this module's tests (see the docstring)."""

    def start() -> kit.LocalJob:
        sets, _ = kit.isolated_sets(router_python)
        return kit.LocalJob(tmp_path_factory.mktemp("e2e-local") / "job", sets)

    with kit.Shared(
        start,
        prepare=lambda job: job.wait_state("ready", timeout=READY_S),
        ended=kit.LocalJob.ended,
    ) as shared:
        yield shared


@pytest.fixture
def demo(
    shared_demo: kit.Shared[kit.LocalJob], request: pytest.FixtureRequest
) -> Iterator[kit.LocalJob]:
    """The shared demo job, ready."""
    yield from shared_demo.borrow(request)


@pytest.fixture
def demo_to_stop(shared_demo: kit.Shared[kit.LocalJob]) -> Iterator[kit.LocalJob]:
    """The shared demo job, ready, for a test that ends it (the next test starts another)."""
    yield from shared_demo.consume()


def test_ready_contract(demo: kit.LocalJob) -> None:
    """status.json ready with router_url and the documented fields; targets.json lists every
    agent."""
    status = kit.check_ready_contract(demo.job)
    assert status["slurm_job_id"] is None
    assert status["local_pid"] == demo.proc.pid
    demo.wait_output("READY after", 5)


def test_chat_through_the_router(demo: kit.LocalJob) -> None:
    """A streamed chat returns the stand-ins' text; two at once use both decode nodes."""
    kit.check_chat(demo.job)


def test_gate_latency_reported(demo: kit.LocalJob) -> None:
    """The head logs the gate latency and exports it; printed, bounded only by the budget."""
    kit.check_gate_latency(demo.job, "local")


def test_decode_engine_sigkill_recovers_on_same_ports(demo: kit.LocalJob) -> None:
    """SIGKILL decode-0's engine: same ports, degraded then ready, the router not restarted."""
    kit.check_engine_sigkill_recovers(demo.job)


def test_status_command(demo: kit.LocalJob) -> None:
    """``tilert-submit status J`` and ``--json`` read the running job."""
    done = kit.submit_cmd("status", str(demo.job))
    assert done.returncode == 0, done.stderr
    assert "job: ready" in done.stdout
    assert "decode-1" in done.stdout
    assert "STALE" not in done.stdout
    done = kit.submit_cmd("status", str(demo.job), "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["stale"] is False
    assert view["status"]["state"] == "ready"


def test_stop_leaves_nothing(demo_to_stop: kit.LocalJob) -> None:
    """``tilert-submit stop J``: every process gone within the graces, status.json ``stopped``."""
    # submit, 3 agents, 3 engines, the router
    ports, procs = kit.running_processes(demo_to_stop.job, at_least=7)
    done = kit.submit_cmd("stop", str(demo_to_stop.job), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGKILL" not in done.stdout, done.stdout  # the supervisor exited by itself
    assert demo_to_stop.wait_exit(30) == 0, demo_to_stop.output()
    kit.assert_gone(procs, 5)
    assert not kit.job_processes(demo_to_stop.job, ports)
    kit.check_stopped(demo_to_stop.job, demo_to_stop.status(), kit.submit_cmd)


# ---- faults, each its own job --------------------------------------------------------------


def failed_exit(job: kit.LocalJob, timeout: float) -> dict[str, Any]:
    """tilert-submit exits 1 within ``timeout``; status.json then."""
    assert job.wait_exit(timeout) == 1, job.output()
    return job.status()


def test_decode_crash_loop_is_dropped(router_python: Path, tmp_path: Path) -> None:
    """decode-1 in a crash loop: dropped, the job keeps serving degraded through decode-0."""
    sets, _ = kit.isolated_sets(router_python, *kit.DECODE_CRASH_LOOP)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        kit.check_decode_dropped(job.job, READY_S)
        # Still serving a moment later (the job does not fail with one decode left).
        status = kit.wait_state(job.job, "degraded", 5)
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()
        assert kit.wait_state(job.job, "stopped", 5)


def test_prefill_crash_loop_fails_the_job(router_python: Path, tmp_path: Path) -> None:
    """The prefill crash-looping: failed, naming prefill-0, its reason and log; exit 1."""
    sets, _ = kit.isolated_sets(router_python, *kit.PREFILL_CRASH_LOOP)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        status = failed_exit(job, READY_S)
        assert "job failed" in job.output()
        kit.check_prefill_failed(job.job, status)


def test_workers_never_healthy_fail_the_job(router_python: Path, tmp_path: Path) -> None:
    """Decodes that never answer within a small startup budget: failed, naming them."""
    sets, _ = kit.isolated_sets(router_python, *kit.DECODES_NEVER_HEALTHY)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        kit.check_decodes_never_healthy(job.job, failed_exit(job, READY_S))


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
        with kit.LocalJob(tmp_path / "job", sets) as job:
            status = failed_exit(job, 30)
            assert status["state"] == "failed", status
            assert f"router port {port} is taken" in status["error"], status["error"]
            kit.assert_nothing_left(job.job, 10)


def test_submit_exits_on_sigint_before_ready(router_python: Path, tmp_path: Path) -> None:
    """Ctrl-C while waiting: every agent stops and tilert-submit exits 0."""
    sets, _ = kit.isolated_sets(router_python, "roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S=30")
    with kit.LocalJob(tmp_path / "job", sets) as job:
        kit.wait_state(job.job, "waiting", READY_S)
        _, procs = kit.running_processes(job.job, at_least=0)
        job.proc.send_signal(signal.SIGINT)
        assert job.wait_exit(30) == 0, job.output()
        kit.assert_gone(procs, 5)


def test_supervisor_sigkill_takes_everything_along(router_python: Path, tmp_path: Path) -> None:
    """SIGKILL to tilert-submit --local alone: its agents and their engines die with it."""
    sets, _ = kit.isolated_sets(router_python, "roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S=30")
    with kit.LocalJob(tmp_path / "job", sets) as job:
        kit.wait_status(
            job.job,
            lambda s: kit.agent_entry(s, "prefill-0")["state"] == "healthy",
            "with prefill-0 healthy",
            READY_S,
        )
        # submit, 3 agents, 3 engines
        _, procs = kit.running_processes(job.job, at_least=6)
        job.proc.send_signal(signal.SIGKILL)
        job.wait_exit(5)
        kit.assert_gone(procs, 5)
