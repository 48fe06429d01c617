"""The pyxis launcher's nested ``srun --overlap`` step on the real local Slurm (no container
flags)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import trio

from agent.launch import LaunchSpec, PyxisLauncher, PyxisStep
from agent.launch.pyxis import ENGINE_ID_ENV
from tests import kit
from tests.infra.slurm import LocalSlurm
from tests.kit import alive, wait_for, wait_gone

pytestmark = pytest.mark.slurm

NODE = "node2"

GRACEFUL = textwrap.dedent(
    """
    import os, signal, sys, time
    def term(*_):
        print("got TERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    env = os.environ
    print("up", os.getpid(), env.get("FROM_SPEC"), env.get("SLURM_STEP_ID"), flush=True)
    time.sleep(600)
    """
)
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('up', flush=True)\ntime.sleep(600)"
)


@pytest.fixture
def job(slurm: LocalSlurm) -> str:
    """A running job holding NODE (its batch script just sleeps); the agent is outside it."""
    job_id = slurm.sbatch("#!/bin/sh\nexec sleep 300\n", "-N1", f"--nodelist={NODE}")
    assert slurm.wait_job_state(job_id, ["RUNNING"]) == "RUNNING"
    return job_id


def launcher(slurm: LocalSlurm, job: str) -> PyxisLauncher:
    """A PyxisLauncher for ``job`` on NODE, with the local cluster's SLURM_CONF."""
    return PyxisLauncher(job, NODE, env=slurm.env, step_end_timeout_s=15)


def step_ids(slurm: LocalSlurm, job: str) -> list[str]:
    """The job's steps squeue still lists."""
    return slurm.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"]).stdout.split()


async def engine_pid(engine: PyxisStep, limit_s: float = 20) -> int:
    """The leader pid once the launcher has found it on the node."""
    await kit.until(lambda: engine.pid is not None, "the step's leader pid on the node", limit_s)
    assert engine.pid is not None
    return engine.pid


async def first_line(engine: PyxisStep) -> str:
    """The step's first output line."""
    data = b""
    with trio.fail_after(20):
        while b"\n" not in data:
            chunk = await engine.output.receive_some(4096)
            assert chunk, f"EOF before a line: {data!r}"
            data += chunk
    return data.decode().splitlines()[0]


async def rest(engine: PyxisStep) -> bytes:
    """The remaining output up to EOF."""
    data = b""
    with trio.fail_after(20):
        while chunk := await engine.output.receive_some(4096):
            data += chunk
    return data


async def test_nested_step_graceful_stop(slurm: LocalSlurm, job: str) -> None:
    spec = LaunchSpec(
        name="decode-0",
        argv=[sys.executable, "-c", GRACEFUL],
        env={**slurm.env, "FROM_SPEC": "yes"},
    )
    engine = await launcher(slurm, job).start(spec)
    try:
        assert engine.step is not None
        assert engine.step.startswith(f"{job}.")
        up = (await first_line(engine)).split()
        pid = await engine_pid(engine)
        # The leader is the engine itself on this node, not the srun client; env reached it.
        assert up[:3] == ["up", str(pid), "yes"]
        assert pid != engine.srun_pid
        assert up[3] == engine.step.split(".")[1]  # it runs in its own (nested) step
        proc = psutil.Process(pid)
        assert ENGINE_ID_ENV in proc.environ()
        assert pid in [p.pid for p in engine.descendants()]
        t0 = time.monotonic()
        status = await engine.stop(grace_s=10)
        assert status == 0, await rest(engine)
        assert time.monotonic() - t0 < 10  # it exited on TERM, not after the grace
        assert b"got TERM" in await rest(engine)
        assert not alive(pid)
        assert engine.step not in step_ids(slurm, job)
        assert slurm.job_state(job) == "RUNNING"  # only the step ended
    finally:
        engine.kill()


async def test_nested_step_killed_after_grace(slurm: LocalSlurm, job: str) -> None:
    spec = LaunchSpec(name="prefill-0", argv=[sys.executable, "-c", STUBBORN], env=slurm.env)
    engine = await launcher(slurm, job).start(spec)
    try:
        assert await first_line(engine) == "up"
        pid = await engine_pid(engine)
        t0 = time.monotonic()
        status = await engine.stop(grace_s=1)
        assert time.monotonic() - t0 >= 1
        assert status == -signal.SIGKILL
        assert not alive(pid)
        assert await engine.stop(grace_s=1) == status  # idempotent
    finally:
        engine.kill()


async def test_run_through_a_nested_step(slurm: LocalSlurm, job: str) -> None:
    spec = LaunchSpec(name="x-preflight", argv=["sh", "-c", "echo hi; exit 3"], env=slurm.env)
    code, out = await launcher(slurm, job).run(spec, timeout_s=30)
    # srun's own messages ("task 0: Exited with exit code 3") share the pipe with the task's.
    assert code == 3
    assert b"hi\n" in out


AGENT = textwrap.dedent(
    """
    import os, sys, trio
    from agent.launch import LaunchSpec, PyxisLauncher

    async def main():
        launcher = PyxisLauncher(sys.argv[1], sys.argv[2])
        engine = await launcher.start(LaunchSpec(
            name="decode-0", argv=["sleep", "600"], env=dict(os.environ)
        ))
        while engine.pid is None:
            await trio.sleep(0.1)
        print(engine.pid, engine.srun_pid, engine.step, flush=True)
        await trio.sleep(600)

    trio.run(main)
    """
)


def test_sigkill_of_the_agent_ends_the_step(slurm: LocalSlurm, job: str) -> None:
    repo = Path(__file__).resolve().parent.parent
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, job, NODE],
        stdout=subprocess.PIPE,
        cwd=repo,
        env={**slurm.env, "PYTHONPATH": str(repo)},
    )
    pids: list[int] = []
    try:
        assert agent.stdout is not None
        pid, client, step = agent.stdout.readline().decode().split()
        pids = [int(pid), int(client)]
        assert alive(int(pid))
        agent.kill()
        agent.wait()
        # The lifeline watcher sees EOF and scancels the step; PDEATHSIG ends the srun client.
        assert not wait_gone(pids, 5)
        # The step itself is gone from squeue once slurmstepd has wound it up.
        wait_for(
            f"step {step} gone from squeue",
            lambda: step_ids(slurm, job),
            15,
            until=lambda steps: step not in steps,
            interval=0.2,
        )
    finally:
        agent.kill()
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
