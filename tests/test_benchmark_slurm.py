"""The benchmark stage on the real local 3-node Slurm, with the REAL router and the REAL AIPerf.

``keep_serving: false`` (the default): the head runs the benchmark once the job is ready, then
ends the whole job with ``scancel --signal=TERM`` (every agent drains) and the Slurm job ends
COMPLETED; a decode answering no token fails the benchmark, the head exits 1 and the Slurm job
ends non-zero. The local equivalents and the finer checks are in tests/test_benchmark_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import kit
from tests.infra.slurm import LocalSlurm
from tests.test_benchmark_e2e import BENCH_S, ISL, OSL, REQUESTS, aiperf_sets, check_counts
from tests.test_e2e_slurm import READY_S, SlurmJob

pytestmark = [pytest.mark.slurm, pytest.mark.router, pytest.mark.aiperf]


def run(slurm: LocalSlurm, root: Path, router_python: Path, *sets: str) -> tuple[SlurmJob, str]:
    """Submit the demo with ``sets``; the job and its final Slurm state."""
    cluster = slurm.write_cluster_file(root / "srtslurm.yaml")
    args, _ = kit.isolated_sets(router_python, *sets)
    with SlurmJob(slurm, root / "job", cluster, args) as job:
        end = slurm.wait_job_end(job.id, timeout=READY_S + BENCH_S + slurm.kill_wait_s)
        return job, end


def test_benchmark_passes_and_the_job_ends(
    slurm: LocalSlurm, router_python: Path, aiperf: Path, tmp_path: Path
) -> None:
    job, end = run(slurm, tmp_path, router_python, *aiperf_sets(aiperf))
    assert end == "COMPLETED", (end, kit.log_tails(job.job))
    status = kit.current_status(job.job)
    assert status["state"] == "stopped", status
    assert status["benchmark"]["state"] == "passed", status
    result = json.loads((job.job / "benchmark" / "summary.json").read_text())
    check_counts(result["levels"], [1, 4], REQUESTS, ISL, OSL)
    assert result["plots"], result
    kit.assert_nothing_left(job.job, 10)


def test_no_token_fails_the_benchmark_and_the_slurm_job(
    slurm: LocalSlurm, router_python: Path, aiperf: Path, tmp_path: Path
) -> None:
    fault = "roles.decode.env.TILERT_MOCK_NO_TOKENS_AFTER_REQUESTS=1"
    job, end = run(slurm, tmp_path, router_python, *aiperf_sets(aiperf, fault, levels="[2]"))
    assert end in ("FAILED", "CANCELLED"), end  # the head exited 1: the batch script exits 1
    status = kit.current_status(job.job)
    assert status["state"] == "failed", status
    assert "concurrency 2: 0 output tokens" in status["benchmark"]["error"], status
    kit.assert_nothing_left(job.job, 10)
