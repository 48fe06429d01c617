"""A site's own batch script (docs/batch-script.md) on the real local 3-node Slurm: the example
``docs/examples/site-batch.sh`` as it is, on a job folder made with ``--dry-run``, brings the
demo (stand-in engines, the real TileRT router) to ``ready``, serves a chat, and ends cleanly on
``tilert-submit stop``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import kit
from tests.conftest import require
from tests.infra.slurm import ENDED_STATES, LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.router]

SCRIPT = kit.REPO / "docs" / "examples" / "site-batch.sh"
READY_S = 90.0  # generous: 2 shared cores, sbatch + srun steps, the real router's imports


def test_example_script_is_clean_shell() -> None:
    require(shutil.which("shellcheck") is not None, "shellcheck not installed")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_site_script_serves_and_stops(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    sets, _ = kit.isolated_sets(router_python)
    job = tmp_path / "job"
    done = kit.submit_cmd(
        str(kit.DEMO_RECIPE),
        "--mock",
        "--dry-run",
        "--cluster",
        str(slurm_cluster_file),
        "--job-dir",
        str(job),
        *sets,
        env=slurm.env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    agent = Path(sys.executable).parent / "tilert-agent"
    slurm_id = slurm.sbatch(
        SCRIPT,
        f"--output={job / 'logs' / 'sbatch.out'}",
        f"--export=ALL,JOB_DIR={job},TILERT_AGENT={agent}",
    )
    try:
        status = kit.wait_state(job, "ready", READY_S)
        # The head learnt the Slurm job from its step's environment: stop and status use it.
        assert status["slurm_job_id"] == slurm_id
        nodes = sorted(kit.agent_entry(status, n)["node"] for n in kit.AGENTS)
        assert nodes == ["node1", "node2", "node3"], nodes
        kit.check_chat(job)
        ports, procs = kit.running_processes(job, at_least=7)  # 3 agents, 3 engines, the router
        stop = kit.submit_cmd("stop", str(job), env=slurm.env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        kit.assert_gone(procs, slurm.kill_wait_s + 10)
        assert not kit.job_processes(job, ports)
        # Every agent drained and exited 0: the script's own exit code is the head's.
        assert slurm.wait_job_end(slurm_id, timeout=30) == "COMPLETED"
        kit.wait_state(job, "stopped", 5)
    finally:
        leftovers = kit.job_processes(job, kit.job_ports(job))
        if slurm.job_state(slurm_id) not in (None, *ENDED_STATES):
            slurm.scancel(slurm_id)
            slurm.wait_job_end(slurm_id, timeout=slurm.kill_wait_s + 15)
        kit.kill_all(leftovers)
