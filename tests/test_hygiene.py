"""Node hygiene before the load (docs/preflight.md): real processes left by an ended job, a fake
``nvidia-smi`` on PATH reporting a foreign process, stale shared-memory files in a private folder,
a file system short of space; each finding weighed by ``agent.preflight`` and cleaned only when
it says ``clean``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest

from agent.job.paths import JOB_DIR_ENV
from agent.job.preflightpolicy import PreflightPolicy
from agent.node.gpus import parse_gpus, parse_processes, read_gpus
from agent.node.hygiene import NodeScene, inspect_node
from tests.kit import wait_for

QUIET = PreflightPolicy(
    stale_processes="ignore", gpu_processes="ignore", stale_shm="ignore", disk="ignore"
)


def only(**checks: object) -> PreflightPolicy:
    """Every check off except those given."""
    return msgspec.structs.replace(QUIET, **checks)


def scene(tmp_path: Path, env: dict[str, str] | None = None, **kw: object) -> NodeScene:
    """The agent of a job in tmp_path/job, started now (after what the test planted).

    The agent is a process of its own: what the test starts are its siblings, not its children
    (an agent's children are its own engines)."""
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    agent.wait()
    values: dict[str, object] = {
        "job_root": tmp_path / "job",
        "node": "node1",
        "agent_pid": agent.pid,
        "started": time.time(),
        "env": env if env is not None else {"PATH": os.environ["PATH"]},
        "folders": {},
    }
    values.update(kw)
    return NodeScene(**values)  # type: ignore[arg-type]


def ended_job(root: Path, state: str) -> Path:
    root.mkdir(parents=True)
    (root / "status.json").write_text(json.dumps({"state": state}))
    return root


@pytest.fixture
def sleeper() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts; killed after it."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def start(procs: list[subprocess.Popen[bytes]], **env: str) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"], env={**os.environ, **env}
    )
    procs.append(proc)
    # The environment is readable once the interpreter has replaced the fork.
    wait_for("the sleeper's exec", lambda: "-c" in psutil.Process(proc.pid).cmdline(), 30)
    return proc.pid


def test_a_process_of_an_ended_job_is_reported_with_its_cleanup_command(
    tmp_path: Path, sleeper: list[subprocess.Popen[bytes]]
) -> None:
    stopped = ended_job(tmp_path / "old", "stopped")
    running = ended_job(tmp_path / "other", "ready")
    stale = start(sleeper, **{JOB_DIR_ENV: str(stopped)})
    gone = start(sleeper, **{JOB_DIR_ENV: str(tmp_path / "deleted")})
    live = start(sleeper, **{JOB_DIR_ENV: str(running)})
    mine = start(sleeper, **{JOB_DIR_ENV: str(tmp_path / "job")})
    policy = only(stale_processes="fail")
    report = inspect_node(scene(tmp_path), policy)
    by_pid = {f.target: f for f in report.failures}
    assert set(by_pid) >= {str(stale), str(gone)}
    assert str(live) not in by_pid  # its job still runs
    assert str(mine) not in by_pid  # our own job
    assert f"its job ({stopped}) is stopped" in by_pid[str(stale)].what
    assert "is gone" in by_pid[str(gone)].what
    assert by_pid[str(stale)].fix.startswith(f"kill {stale}")
    assert by_pid[str(stale)].line().startswith(f"stale_processes: pid {stale} ")
    # warn: the same findings, logged only.
    warned = inspect_node(scene(tmp_path), only(stale_processes="warn"))
    assert not warned.failures
    assert {str(stale), str(gone)} <= {f.target for f in warned.warnings}
    # A process started after the agent is not an earlier job's.
    later = inspect_node(scene(tmp_path, started=0.0), policy)
    assert str(stale) not in {f.target for f in later.failures}


def test_clean_kills_the_stale_processes_and_says_so(
    tmp_path: Path, sleeper: list[subprocess.Popen[bytes]]
) -> None:
    stopped = ended_job(tmp_path / "old", "failed")
    stale = start(sleeper, **{JOB_DIR_ENV: str(stopped)})
    report = inspect_node(scene(tmp_path), only(stale_processes="clean"))
    assert f"killed pid {stale}" in report.cleaned
    assert not report.failures
    assert sleeper[0].wait(timeout=10) is not None


def test_a_slurm_process_is_stale_once_its_job_left_the_node(
    tmp_path: Path, sleeper: list[subprocess.Popen[bytes]]
) -> None:
    # A fake squeue: job 7 runs on this node, job 5 does not any more.
    bin_dir = tmp_path / "bin"
    fake(bin_dir / "squeue", 'echo "7|2026-01-01T00:00:00"')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_CONF": "/c"}
    old = start(sleeper, **{JOB_DIR_ENV: "/j5", "SLURM_JOB_ID": "5", "SLURM_CONF": "/c"})
    current = start(sleeper, **{JOB_DIR_ENV: "/j7", "SLURM_JOB_ID": "7", "SLURM_CONF": "/c"})
    elsewhere = start(sleeper, **{JOB_DIR_ENV: "/j3", "SLURM_JOB_ID": "3", "SLURM_CONF": "/d"})
    policy = only(stale_processes="fail")
    found = {f.target: f for f in inspect_node(scene(tmp_path, env), policy).failures}
    assert "its Slurm job 5 no longer runs on this node" in found[str(old)].what
    assert str(current) not in found
    assert str(elsewhere) not in found  # another Slurm's job: not ours to judge


def fake(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_nvidia_smi(bin_dir: Path, pid: int, used_mib: int) -> None:
    """An nvidia-smi answering the two queries the check asks."""
    fake(
        bin_dir / "nvidia-smi",
        'case "$1" in\n'
        f'  --query-gpu=*) echo "0, GPU-aaa, {used_mib}, 81920"; echo "1, GPU-bbb, 3, 81920" ;;\n'
        f'  --query-compute-apps=*) echo "{pid}, GPU-aaa, {used_mib}, /usr/bin/python3" ;;\n'
        "  *) exit 9 ;;\nesac",
    )


def test_a_foreign_gpu_process_and_a_full_gpu_are_reported(
    tmp_path: Path, sleeper: list[subprocess.Popen[bytes]]
) -> None:
    foreign = start(sleeper)
    fake_nvidia_smi(tmp_path / "bin", foreign, 40000)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    policy = only(gpu_processes="fail")
    report = inspect_node(scene(tmp_path, env), policy)
    lines = [f.line() for f in report.failures]
    assert any(
        f"pid {foreign} (/usr/bin/python3, user " in line and "holds 40000 MiB on GPU 0" in line
        for line in lines
    ), lines
    assert any("GPU 0 has 41920 of 81920 MiB free (51%)" in line for line in lines), lines
    assert not any("GPU 1 " in line for line in lines)
    assert all("clean with:" in line for line in lines)
    # Only the job's GPUs count: GPU 1 alone is clean.
    only_1 = inspect_node(scene(tmp_path, env, visible_gpus=frozenset({"1"})), policy)
    assert only_1.failures == []


def test_without_a_gpu_tool_there_is_a_note_for_a_gpu_role(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}  # neither nvidia-smi nor amd-smi here
    policy = only(gpu_processes="fail")
    report = inspect_node(scene(tmp_path, env, uses_gpus=True), policy)
    assert report.failures == []
    assert report.notes == [read_gpus(env).note]
    assert "neither nvidia-smi nor amd-smi/rocm-smi" in report.notes[0]
    assert inspect_node(scene(tmp_path, env, uses_gpus=False), policy).notes == []


def test_the_nvidia_smi_csv_is_read() -> None:
    gpus = parse_gpus("0, GPU-a, 10, 100\n1, GPU-b, [N/A], [N/A]\n\n")
    assert [g.index for g in gpus] == ["0", "1"]
    assert gpus[0].free_fraction == pytest.approx(0.9)
    assert gpus[1].free_fraction == 1.0
    procs = parse_processes("12, GPU-b, 5, python, with a comma\nbad, GPU-a, 1, x\n", gpus)
    assert [(p.pid, p.gpu, p.name) for p in procs] == [(12, "1", "python, with a comma")]


def test_stale_shared_memory_files_are_reported_and_cleaned_only_when_asked(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    hour_ago = time.time() - 3600
    for name in ("nccl-old-1", "torch_12_held", "psm_fresh", "unrelated-old"):
        (shm / name).write_bytes(b"x" * 1024)
        os.utime(shm / name, (hour_ago, hour_ago))
    os.utime(shm / "psm_fresh")  # written now, after the job (a minute old) began
    began = time.time() - 60
    with (shm / "torch_12_held").open("rb"):  # open by a live process (this one)
        policy = only(stale_shm="warn", shm_dir=str(shm))
        report = inspect_node(scene(tmp_path, started=began), policy)
        assert [f.target for f in report.warnings] == [str(shm / "nccl-old-1")]
        assert report.warnings[0].fix == f"rm -f {shm / 'nccl-old-1'}"
        assert "before the node's current jobs began" in report.warnings[0].what
        assert (shm / "nccl-old-1").exists()  # warn deletes nothing
        policy = only(stale_shm="clean", shm_dir=str(shm))
        cleaned = inspect_node(scene(tmp_path, started=began), policy)
    assert cleaned.cleaned == [f"removed {shm / 'nccl-old-1'}"]
    assert sorted(os.listdir(shm)) == ["psm_fresh", "torch_12_held", "unrelated-old"]


def test_a_folder_short_of_space_fails_by_default(tmp_path: Path) -> None:
    folders = {"weights (roles.decode.args.model-weights-dir)": str(tmp_path / "w" / "not-yet")}
    policy = only(disk="fail", min_free_disk_gib=1_000_000)
    report = inspect_node(scene(tmp_path, folders=folders), policy)
    assert len(report.failures) == 1
    line = report.failures[0].line()
    assert line.startswith(f"disk: {tmp_path / 'w' / 'not-yet'} (weights (roles.decode.args.")
    assert "below agent.preflight.min_free_disk_gib 1e+06" in line
    assert f"du -xsh {tmp_path}/*" in line  # the nearest folder that exists
    assert PreflightPolicy().disk == "fail"
    enough = only(disk="fail", min_free_disk_gib=0)
    assert inspect_node(scene(tmp_path, folders=folders), enough).failures == []
