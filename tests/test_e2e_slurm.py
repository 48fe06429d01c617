"""End to end on the real local 3-node Slurm, with the REAL TileRT router (GitHub "Cluster bring-up").

``tilert-submit RECIPE --mock --cluster <the fixture's cluster file>`` runs sbatch; the agents run
on node1..node3 through the script's srun steps (process launcher, loopback). One demo job is
brought up and reused in file order (contract, chat, gate latency, an engine SIGKILL, status),
then stopped with ``tilert-submit stop``; each fault scenario runs a job of its own. At the end,
the pyxis launcher's nested ``srun --overlap`` step (no container flags) starts and stops an engine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import trio

from agent.launchers import LaunchSpec, PyxisLauncher
from tests import e2ekit as kit
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
        status = kit.read_status(job)
        assert status is not None and status["slurm_job_id"], status
        self.id: str = status["slurm_job_id"]

    def cmd(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A job command (status, stop) against this cluster."""
        return kit.submit_cmd(*args, env=self.slurm.env)

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
def demo(
    module_slurm: LocalSlurm, router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SlurmJob]:
    """The demo recipe on the local Slurm, ready."""
    root = tmp_path_factory.mktemp("e2e-slurm")
    cluster = module_slurm.write_cluster_file(root / "srtslurm.yaml")
    sets, _ = kit.e2e_sets(router_python)
    with SlurmJob(module_slurm, root / "job", cluster, sets) as job:
        kit.wait_state(job.job, "ready", READY_S)
        yield job


def test_ready_contract(demo: SlurmJob) -> None:
    """Ready with router_url; agents on node1..node3 with DESIGN.md's fields; targets.json."""
    status = kit.read_status(demo.job)
    assert status is not None and status["state"] == "ready", status
    assert status["slurm_job_id"] == demo.id and status["local_pid"] is None
    assert status["router_url"].startswith("http://127.0.0.1:")
    for entry in status["agents"]:
        assert set(entry) >= kit.AGENT_FIELDS, entry
        assert entry["state"] == "healthy", entry
    nodes = [kit.agent_entry(status, n)["node"] for n in ("prefill-0", "decode-0", "decode-1")]
    assert sorted(nodes) == ["node1", "node2", "node3"], nodes
    targets = kit.json.loads((demo.job / "prometheus" / "targets.json").read_text())
    assert sorted(t["labels"]["agent"] for t in targets) == ["decode-0", "decode-1", "prefill-0"]
    assert all(set(t["labels"]) == {"agent"} for t in targets), targets
    router_log = (demo.job / "logs" / "prefill-0" / "router.log").read_text()
    assert "tilert.pd_vllm.pd_router" in router_log.splitlines()[0]
    # Metrics carry the Slurm job id (the targets file adds none).
    page = kit.httpx.get(kit.agent_entry(status, "decode-1")["metrics_url"], timeout=5).text
    assert f'slurm_job_id="{demo.id}"' in page


def test_chat_and_two_at_once(demo: SlurmJob) -> None:
    """A streamed chat through router_url; two concurrent ones (two decode nodes)."""
    status = kit.read_status(demo.job)
    assert status is not None
    assert kit.chat(status["router_url"], "demo-model") == kit.ANSWER
    assert kit.chat_concurrently(status["router_url"], "demo-model", 2) == [kit.ANSWER] * 2


def test_gate_latency_reported(demo: SlurmJob) -> None:
    """Printed, and only checked to be present and under the startup budget."""
    log = (demo.job / "logs" / "prefill-0" / "agent.log").read_text()
    line = next(x for x in log.splitlines() if "router started" in x)
    status = kit.read_status(demo.job)
    assert status is not None
    metrics = kit.agent_entry(status, "prefill-0")["metrics_url"]
    gate = kit.metric_value(metrics, "tilert_agent_gate_latency_seconds")
    print(f"\nslurm gate latency: metric {gate} s; log: {line.split('head: ', 1)[-1]}")
    assert gate is not None and 0 <= gate < 60


def test_decode_engine_sigkill_recovers(demo: SlurmJob) -> None:
    """SIGKILL decode-0's engine on its node: same ports, degraded -> ready, router untouched."""
    status = kit.read_status(demo.job)
    assert status is not None
    d0 = kit.agent_entry(status, "decode-0")
    before = kit.agent_status(d0["status_url"])
    head = kit.agent_status(kit.agent_entry(status, "prefill-0")["status_url"])
    router_pid = head["router"]["pid"]
    seen: list[str] = []
    psutil.Process(before["pid"]).send_signal(signal.SIGKILL)
    kit.wait_state(demo.job, "degraded", 15, seen=seen)
    after_status = kit.wait_state(demo.job, "ready", 30, seen=seen)
    print(f"\nstates after the SIGKILL: {seen}")
    after = kit.agent_status(d0["status_url"])
    assert after["pid"] != before["pid"] and after["ports"] == before["ports"]
    assert after["restarts"] == before["restarts"] + 1
    head = kit.agent_status(kit.agent_entry(after_status, "prefill-0")["status_url"])
    assert head["router"]["pid"] == router_pid and head["router"]["restarts"] == 0
    assert kit.chat_concurrently(after_status["router_url"], "demo-model", 2) == [kit.ANSWER] * 2


def test_status_command(demo: SlurmJob) -> None:
    """``status J`` and ``--json`` on a running Slurm job."""
    done = demo.cmd("status", str(demo.job))
    assert done.returncode == 0, done.stderr
    assert "job: ready" in done.stdout and f"slurm job: {demo.id}" in done.stdout
    view = kit.json.loads(demo.cmd("status", str(demo.job), "--json").stdout)
    assert view["stale"] is False and view["status"]["slurm_job_id"] == demo.id


def test_stop_drains_within_kill_wait(demo: SlurmJob) -> None:
    """``stop J``: scancel --signal=TERM; everything gone within KillWait, job ended, ``stopped``."""
    ports = kit.job_ports(demo.job)
    procs = kit.job_processes(demo.job, ports)
    assert len(procs) >= 7, kit.describe(procs)  # 3 agents, 3 engines, the router, ...
    done = demo.cmd("stop", str(demo.job))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "scancel --signal=TERM" in done.stdout  # (--full or not: submit/stop.py says why)
    assert "still running" not in done.stdout, done.stdout  # ended without the hard scancel
    left = kit.wait_gone(procs, demo.slurm.kill_wait_s)
    assert not left, "left behind:\n" + kit.describe(left)
    assert not kit.job_processes(demo.job, ports)
    assert demo.slurm.wait_job_end(demo.id, timeout=30) == "COMPLETED"
    status = kit.wait_state(demo.job, "stopped", 5)
    assert status["router_url"] is None
    assert demo.cmd("stop", str(demo.job)).returncode == 0
    # A "ready" left behind by a job that has ended is reported as stale.
    (demo.job / "status.json").write_text(kit.json.dumps(dict(status, state="ready")))
    view = kit.json.loads(demo.cmd("status", str(demo.job), "--json").stdout)
    assert view["stale"] is True and "ended" in view["stale_reason"], view
    assert "STALE" in demo.cmd("status", str(demo.job)).stdout


# ---- faults, each its own job --------------------------------------------------------------


def test_decode_crash_loop_is_dropped(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    """decode-1 crash-looping: dropped; the job serves degraded through decode-0."""
    sets, _ = kit.e2e_sets(
        router_python,
        "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
        "roles.decode.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
        "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 2, window_s: 60}",
    )
    with SlurmJob(slurm, tmp_path / "job", slurm_cluster_file, sets) as job:
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
        assert d1["log"].endswith("logs/decode-1/engine.log") and "gave up" in d1["reason"], d1
        assert kit.chat(status["router_url"], "demo-model") == kit.ANSWER
        assert slurm.job_state(job.id) == "RUNNING"  # decode-1's exit 1 did not end the job
        done = job.cmd("stop", str(job.job))
        assert done.returncode == 0, done.stdout + done.stderr
        kit.wait_state(job.job, "stopped", 15)


def test_prefill_crash_loop_fails_the_job(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    """The prefill crash-looping: failed naming prefill-0, reason and log; the job ends."""
    sets, _ = kit.e2e_sets(
        router_python,
        "roles.prefill.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
        "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 1, window_s: 60}",
    )
    with SlurmJob(slurm, tmp_path / "job", slurm_cluster_file, sets) as job:
        status = kit.wait_state(job.job, "failed", READY_S)
        assert "prefill-0" in status["error"] and "logs/prefill-0/engine.log" in status["error"]
        # The prefill step exits 1, the script cancels the job: nothing is left running.
        end = slurm.wait_job_end(job.id, timeout=30 + slurm.kill_wait_s)
        assert end in ("FAILED", "CANCELLED"), end
        assert "exiting with code 1" in (job.job / "logs/prefill-0/agent.log").read_text()
        assert not kit.wait_gone(kit.job_processes(job.job, kit.job_ports(job.job)), 10)


def test_workers_never_healthy_fail_the_job(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    """Decodes whose /health never answers within a small budget: failed, naming them."""
    sets, _ = kit.e2e_sets(
        router_python,
        "roles.decode.env.TILERT_MOCK_HANG_HEALTH=1",
        "agent.startup_budget_s={prefill: 3, decode: 3, router: 60}",
    )
    with SlurmJob(slurm, tmp_path / "job", slurm_cluster_file, sets) as job:
        status = kit.wait_state(job.job, "failed", READY_S)
        for name in ("decode-0", "decode-1"):
            assert f"logs/{name}/engine.log" in status["error"], status["error"]
        end = slurm.wait_job_end(job.id, timeout=30 + slurm.kill_wait_s)
        assert end in ("FAILED", "CANCELLED"), end
        assert not kit.wait_gone(kit.job_processes(job.job, kit.job_ports(job.job)), 10)


# ---- the pyxis launcher's nested step, without container flags -----------------------------

ENGINE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("engine got TERM", flush=True), sys.exit(143)))
print("engine up", os.getpid(), os.environ.get("SLURM_STEP_ID"), flush=True)
while True:
    time.sleep(0.1)
"""


async def test_pyxis_nested_overlap_step(slurm: LocalSlurm, tmp_path: Path) -> None:
    """An engine as ``srun --overlap`` inside a running job: found, then stopped by TERM."""
    holder = slurm.sbatch("#!/bin/sh\nsleep 120\n", "-N1", "-w", "node2")
    slurm.wait_job_state(holder, ("RUNNING",), timeout=30)
    launcher = PyxisLauncher(holder, "node2", step_lookup_timeout_s=20, step_end_timeout_s=10)
    launcher.client_env = dict(slurm.env)
    spec = LaunchSpec(name="decode-0", argv=[sys.executable, "-c", ENGINE], env=dict(slurm.env))
    engine = await launcher.start(spec)
    output = b""
    try:
        assert engine.step is not None and engine.step.startswith(f"{holder}.")
        with trio.fail_after(20):
            while b"engine up" not in output:
                output += await engine.output.receive_some(4096)
            while engine.pid is None:
                await trio.sleep(0.1)
        proc = psutil.Process(engine.pid)
        assert proc.cmdline()[:2] == [sys.executable, "-c"], proc.cmdline()
        assert str(engine.pid) in output.decode()
        steps = [j["id"] for j in slurm.squeue()]  # the holder job is still there
        assert holder in steps
        with trio.fail_after(30):
            code = await engine.stop(5.0)
        # srun reports exit 143 as 128+15, which the launcher spells -15 (as a TERM death).
        with trio.move_on_after(5):
            while chunk := await engine.output.receive_some(4096):
                output += chunk
        assert code in (143, -15), (code, output)
        assert b"engine got TERM" in output, output  # TERM reached it: no SIGKILL abort
        assert not kit.wait_gone([proc], 2)
    finally:
        engine.kill()
        slurm.scancel(holder)
        slurm.wait_job_end(holder, timeout=slurm.kill_wait_s + 15)
