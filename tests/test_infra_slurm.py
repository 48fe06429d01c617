"""The local multi-node Slurm behaves like the real thing in the ways the agent relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.recipe.cluster import load_cluster
from tests.conftest import require
from tests.infra.slurm import LocalSlurm, missing_binaries
from tests.kit import wait_for, wait_gone

pytestmark = pytest.mark.slurm


def wait_file(path: Path, timeout: float = 20.0) -> str:
    """The file's text once it exists and is not empty."""
    return wait_for(f"{path} written", path.read_text, timeout)


def test_srun_runs_once_per_node(slurm: LocalSlurm) -> None:
    done = slurm.srun(
        "-N3",
        "--ntasks-per-node=1",
        "sh",
        "-c",
        'echo "$SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID $(hostname)"',
    )
    rows = sorted(line.split() for line in done.stdout.splitlines())
    assert [r[0] for r in rows] == ["node1", "node2", "node3"]
    assert sorted(r[1] for r in rows) == ["0", "1", "2"]
    assert sorted(r[2] for r in rows) == ["0", "1", "2"]
    if slurm.hostnames_isolated:
        assert all(r[3] == r[0] for r in rows), rows


def test_node_names_resolve_inside_jobs(slurm: LocalSlurm) -> None:
    require(
        slurm.hostnames_isolated,
        "unshare --uts --mount is not available here: node names do not resolve",
    )
    done = slurm.srun("-N1", "-w", "node2", "getent", "hosts", "node3")
    assert done.stdout.split()[0] == "127.0.0.1"


def test_sbatch_runs_and_ends(slurm: LocalSlurm, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = slurm.sbatch(f'#!/bin/sh\necho "job=$SLURM_JOB_ID" > {out}\n', "-N1")
    assert slurm.wait_job_end(job, timeout=30) == "COMPLETED"
    assert out.read_text().strip() == f"job={job}"


def test_failed_batch_script_is_failed(slurm: LocalSlurm) -> None:
    job = slurm.sbatch("#!/bin/sh\nexit 3\n", "-N1")
    assert slurm.wait_job_end(job, timeout=30) == "FAILED"
    assert slurm.job_info(job)["ExitCode"] == "3:0"


def test_scancel_term_full_reaches_batch_shell(slurm: LocalSlurm, tmp_path: Path) -> None:
    ready, got = tmp_path / "ready", tmp_path / "got-term"
    script = f"""#!/bin/bash
trap 'echo term > {got}; exit 0' TERM
echo up > {ready}
while :; do sleep 0.1; done
"""
    job = slurm.sbatch(script, "-N1")
    wait_file(ready)
    slurm.scancel("--signal=TERM", "--full", job)
    assert wait_file(got).strip() == "term"
    # The shell handled the signal and exited 0, so the job ends normally.
    assert slurm.wait_job_end(job, timeout=30) == "COMPLETED"


def test_nested_overlap_step_inside_allocation(slurm: LocalSlurm, tmp_path: Path) -> None:
    # As the pyxis launcher does: from inside a step, start another step of the same job.
    out = tmp_path / "nested.txt"
    inner = f'srun --overlap --jobid="$SLURM_JOB_ID" -N1 -n1 sh -c "echo \\$SLURM_STEP_ID" > {out}'
    script = f"#!/bin/sh\nsrun -N1 --ntasks-per-node=1 sh -c '{inner}'\n"
    job = slurm.sbatch(script, "-N1")
    assert slurm.wait_job_end(job, timeout=30) == "COMPLETED", slurm.log_tail()
    # Step 0 is the outer srun; the nested one is a step of its own.
    assert out.read_text().strip() == "1"


def test_overlap_step_from_outside_a_busy_job(slurm: LocalSlurm) -> None:
    job = slurm.sbatch("#!/bin/sh\nsrun -N1 sleep 300\n", "-N1")
    assert slurm.wait_job_state(job, ["RUNNING"]) == "RUNNING"
    done = slurm.srun(f"--jobid={job}", "--overlap", "-N1", "sh", "-c", "echo $SLURM_JOB_ID")
    assert done.stdout.strip() == job
    slurm.scancel(job)
    assert slurm.wait_job_end(job, timeout=30) == "CANCELLED"


def test_cluster_file_loads(slurm_cluster_file: Path) -> None:
    cluster = load_cluster(slurm_cluster_file)
    assert cluster.launcher == "process"
    assert cluster.network_interface == "lo"
    assert cluster.kill_wait_s == 5


def test_stop_leaves_nothing_behind(tmp_path: Path) -> None:
    require(not missing_binaries(), "Slurm not installed")
    with LocalSlurm(1, root=tmp_path / "s") as cluster:
        pidfile = tmp_path / "sleep.pid"
        job = cluster.sbatch(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
        task = int(wait_file(pidfile))
        daemons = [int(p.read_text()) for p in cluster.run_dir.glob("*.pid")]
        assert len(daemons) == 2
        assert cluster.job_state(job) == "RUNNING"
    assert not wait_gone([task, *daemons], 5)
