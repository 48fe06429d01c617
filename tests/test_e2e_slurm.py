"""End to end on the real local 3-node Slurm, with the REAL TileRT router (GitHub "Cluster
bring-up").

``tilert-submit RECIPE --mock --cluster <the fixture's cluster file>`` runs sbatch; the agents run
on node1..node3 through the script's srun steps (process launcher, loopback). The tests that need a
running demo job share one (``demo``: ready before each test; submitted again after a test that
stopped it or failed, or after the ``slurm`` fixture of a fault test cancelled it), so each passes
alone and in any order; the stop test gets it through ``demo_to_stop`` and ends it with
``tilert-submit stop``. Each fault scenario runs a job of its own. At the end, the pyxis
launcher's nested ``srun --overlap`` step (no container flags) starts and stops an engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from agent.launch import LaunchSpec, PyxisLauncher
from tests import kit
from tests.infra.slurm import ENDED_STATES, LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.router]

READY_S = 90.0  # generous: 2 shared cores, sbatch + srun steps, the real router's imports


class SlurmJob:
    """A job submitted through ``tilert-submit --cluster``; cancelled on exit if still there."""

    def __init__(self, slurm: LocalSlurm, job: Path, cluster: Path, args: list[str]) -> None:
        self.slurm = slurm
        self.job = job
        done = kit.submit_cmd(
            str(kit.DEMO_RECIPE),
            "--mock",
            "--cluster",
            str(cluster),
            "--job-dir",
            str(job),
            *args,
            env=slurm.env,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines()[0] == f"Job directory: {job}"
        status = kit.current_status(job)
        assert status["slurm_job_id"], status
        self.id: str = status["slurm_job_id"]

    def cmd(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A job command (status, stop) against this cluster."""
        return kit.submit_cmd(*args, env=self.slurm.env)

    def ended(self) -> bool:
        """The Slurm job has ended (or Slurm no longer knows it)."""
        return self.slurm.job_state(self.id) in (None, *ENDED_STATES)

    def __enter__(self) -> SlurmJob:
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = kit.job_processes(self.job, kit.job_ports(self.job))
        if self.slurm.job_state(self.id) not in (None, *ENDED_STATES):
            self.slurm.scancel(self.id)
            self.slurm.wait_job_end(self.id, timeout=self.slurm.kill_wait_s + 15)
        kit.kill_all(leftovers)


@pytest.fixture(scope="module")
def module_slurm(slurm_session: LocalSlurm) -> LocalSlurm:
    """The session's Slurm for the module-scoped job."""
    return slurm_session


@pytest.fixture(scope="module")
def shared_demo(
    module_slurm: LocalSlurm, router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[kit.Shared[SlurmJob]]:
    """The demo recipe on the local Slurm, shared by this module's tests (see the docstring)."""

    def start() -> SlurmJob:
        root = tmp_path_factory.mktemp("e2e-slurm")
        cluster = module_slurm.write_cluster_file(root / "srtslurm.yaml")
        sets, _ = kit.isolated_sets(router_python)
        return SlurmJob(module_slurm, root / "job", cluster, sets)

    with kit.Shared(
        start,
        prepare=lambda job: kit.wait_state(job.job, "ready", READY_S),
        ended=SlurmJob.ended,
    ) as shared:
        yield shared


@pytest.fixture
def demo(shared_demo: kit.Shared[SlurmJob], request: pytest.FixtureRequest) -> Iterator[SlurmJob]:
    """The shared demo job, ready."""
    yield from shared_demo.borrow(request)


@pytest.fixture
def demo_to_stop(shared_demo: kit.Shared[SlurmJob]) -> Iterator[SlurmJob]:
    """The shared demo job, ready, for a test that ends it (the next test submits another)."""
    yield from shared_demo.consume()


def test_ready_contract(demo: SlurmJob) -> None:
    """Ready with router_url; agents on node1..node3 with the documented fields; targets.json."""
    status = kit.check_ready_contract(demo.job)
    assert status["slurm_job_id"] == demo.id
    assert status["local_pid"] is None
    nodes = [kit.agent_entry(status, n)["node"] for n in kit.AGENTS]
    assert sorted(nodes) == ["node1", "node2", "node3"], nodes
    # Metrics carry the Slurm job id (the targets file adds none).
    page = httpx.get(kit.agent_entry(status, "decode-1")["metrics_url"], timeout=5).text
    assert f'slurm_job_id="{demo.id}"' in page


def test_chat_and_two_at_once(demo: SlurmJob) -> None:
    """A streamed chat through router_url; two concurrent ones (two decode nodes)."""
    kit.check_chat(demo.job)


def test_gate_latency_reported(demo: SlurmJob) -> None:
    """Printed, and only checked to be present and under the startup budget."""
    kit.check_gate_latency(demo.job, "slurm")


def test_decode_engine_sigkill_recovers(demo: SlurmJob) -> None:
    """SIGKILL decode-0's engine on its node: same ports, degraded -> ready, router untouched."""
    kit.check_engine_sigkill_recovers(demo.job)


def test_status_command(demo: SlurmJob) -> None:
    """``status J`` and ``--json`` on a running Slurm job."""
    done = demo.cmd("status", str(demo.job))
    assert done.returncode == 0, done.stderr
    assert "job: ready" in done.stdout
    assert f"slurm job: {demo.id}" in done.stdout
    view = json.loads(demo.cmd("status", str(demo.job), "--json").stdout)
    assert view["stale"] is False
    assert view["status"]["slurm_job_id"] == demo.id


def test_stop_drains_within_kill_wait(demo_to_stop: SlurmJob) -> None:
    """``stop J``: scancel --signal=TERM; everything gone within KillWait, job ended,
    ``stopped``."""
    # 3 agents, 3 engines, the router, ...
    ports, procs = kit.running_processes(demo_to_stop.job, at_least=7)
    done = demo_to_stop.cmd("stop", str(demo_to_stop.job))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "scancel --signal=TERM" in done.stdout  # (--full or not: submit/stop.py says why)
    assert "still running" not in done.stdout, done.stdout  # ended without the hard scancel
    kit.assert_gone(procs, demo_to_stop.slurm.kill_wait_s)
    assert not kit.job_processes(demo_to_stop.job, ports)
    assert demo_to_stop.slurm.wait_job_end(demo_to_stop.id, timeout=30) == "COMPLETED"
    status = kit.wait_state(demo_to_stop.job, "stopped", 5)
    # A "ready" left behind by a job that has ended is reported as stale.
    view = kit.check_stopped(demo_to_stop.job, status, demo_to_stop.cmd)
    assert "ended" in view["stale_reason"], view


# ---- faults, each its own job --------------------------------------------------------------


@pytest.fixture
def fault_job(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> Callable[..., SlurmJob]:
    """``fault_job(*sets)``: a job of its own with the recipe overrides ``sets``."""

    def submit(*sets: str) -> SlurmJob:
        args, _ = kit.isolated_sets(router_python, *sets)
        return SlurmJob(slurm, tmp_path / "job", slurm_cluster_file, args)

    return submit


def test_decode_crash_loop_is_dropped(
    slurm: LocalSlurm, fault_job: Callable[..., SlurmJob]
) -> None:
    """decode-1 crash-looping: dropped; the job serves degraded through decode-0."""
    with fault_job(*kit.DECODE_CRASH_LOOP) as job:
        kit.check_decode_dropped(job.job, READY_S)
        assert slurm.job_state(job.id) == "RUNNING"  # decode-1's exit 1 did not end the job
        done = job.cmd("stop", str(job.job))
        assert done.returncode == 0, done.stdout + done.stderr
        kit.wait_state(job.job, "stopped", 15)


def wait_failed_and_ended(slurm: LocalSlurm, job: SlurmJob) -> dict[str, Any]:
    """status.json ``failed``, then the Slurm job ended (the failing step cancels it); status."""
    status = kit.wait_state(job.job, "failed", READY_S)
    end = slurm.wait_job_end(job.id, timeout=30 + slurm.kill_wait_s)
    assert end in ("FAILED", "CANCELLED"), end
    return status


def test_prefill_crash_loop_fails_the_job(
    slurm: LocalSlurm, fault_job: Callable[..., SlurmJob]
) -> None:
    """The prefill crash-looping: failed naming prefill-0, reason and log; the job ends."""
    with fault_job(*kit.PREFILL_CRASH_LOOP) as job:
        # The prefill step exits 1, the script cancels the job: nothing is left running.
        kit.check_prefill_failed(job.job, wait_failed_and_ended(slurm, job))


def test_workers_never_healthy_fail_the_job(
    slurm: LocalSlurm, fault_job: Callable[..., SlurmJob]
) -> None:
    """Decodes whose /health never answers within a small budget: failed, naming them."""
    with fault_job(*kit.DECODES_NEVER_HEALTHY) as job:
        kit.check_decodes_never_healthy(job.job, wait_failed_and_ended(slurm, job))


# ---- the pyxis launcher's nested step, without container flags -----------------------------

ENGINE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("engine got TERM", flush=True), sys.exit(143)))
print("engine up", os.getpid(), os.environ.get("SLURM_STEP_ID"), flush=True)
while True:
    time.sleep(0.1)
"""


async def test_pyxis_nested_overlap_step(slurm: LocalSlurm) -> None:
    """An engine as ``srun --overlap`` inside a running job: found, then stopped by TERM."""
    holder = slurm.sbatch("#!/bin/sh\nsleep 120\n", "-N1", "-w", "node2")
    slurm.wait_job_state(holder, ("RUNNING",), timeout=30)
    launcher = PyxisLauncher(holder, "node2", step_lookup_timeout_s=20, step_end_timeout_s=10)
    launcher.client_env = dict(slurm.env)
    spec = LaunchSpec(name="decode-0", argv=[sys.executable, "-c", ENGINE], env=dict(slurm.env))
    engine = await launcher.start(spec)
    output = b""
    try:
        assert engine.step is not None
        assert engine.step.startswith(f"{holder}.")
        with kit.within(20, "the engine's 'engine up' line, then its pid"):
            while b"engine up" not in output:
                output += await engine.output.receive_some(4096)
        await kit.until(lambda: engine.pid is not None, "the launcher to find the engine's pid", 20)
        proc = psutil.Process(engine.pid)
        assert proc.cmdline()[:2] == [sys.executable, "-c"], proc.cmdline()
        assert str(engine.pid) in output.decode()
        steps = [j["id"] for j in slurm.squeue()]  # the holder job is still there
        assert holder in steps
        with kit.within(30, "the engine step to stop on TERM"):
            code = await engine.stop(5.0)
        # srun reports exit 143 as 128+15, which the launcher spells -15 (as a TERM death).
        with trio.move_on_after(5):
            while chunk := await engine.output.receive_some(4096):
                output += chunk
        assert code in (143, -15), (code, output)
        assert b"engine got TERM" in output, output  # TERM reached it: no SIGKILL abort
        kit.assert_gone([proc], 2)
    finally:
        engine.kill()
        slurm.scancel(holder)
        slurm.wait_job_end(holder, timeout=slurm.kill_wait_s + 15)
