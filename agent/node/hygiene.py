"""Node hygiene before the load: what an earlier job, or someone else, left on this node.

Four checks (docs/preflight.md), each weighed by ``agent.preflight``: processes of an earlier job
of ours still alive (``stale_processes``), GPU processes of others and GPUs short of free memory
(``gpu_processes``), vLLM, NCCL and torch files in ``/dev/shm`` older than the node's current jobs
and open by nobody (``stale_shm``), and free space in the scratch and weights folders (``disk``).
Every finding names what was found and the command that cleans it; only ``clean`` acts, and says
what it did.

A process is *ours* when it carries ``TILERT_JOB_DIR`` (every agent sets it for what it starts) or
is an agent with ``--job-dir``; it is *stale* when that job is over: its Slurm job is no longer on
this node (asked with ``squeue -w NODE``; a process of another Slurm, with another ``SLURM_CONF``,
is not judged), or, without Slurm, its ``status.json`` says stopped or failed, or its folder is
gone.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import trio

from agent.job.paths import JOB_DIR_ENV
from agent.job.preflightpolicy import PreflightPolicy
from agent.node.gpus import GpuState, read_gpus

# Shared-memory files of the engines: NCCL's, torch's, vLLM's (its own and Python's psm_ blocks).
SHM_PATTERNS = ("nccl-*", "torch_*", "psm_*", "vllm*")
SQUEUE_TIMEOUT_S = 10.0
# How long a cleaned process has between SIGTERM and SIGKILL.
CLEAN_GRACE_S = 5.0
# The most items one finding lists by name (the count says how many more).
MAX_LISTED = 8
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    """One thing found on the node: its check (the policy key), what it is, how to clean it."""

    check: str
    what: str
    fix: str
    # What ``clean`` acts on: a pid or a file path (empty: nothing to clean automatically).
    target: str = ""

    def line(self) -> str:
        """``check: what; clean with: fix`` (one line of the report)."""
        return f"{self.check}: {self.what}; clean with: {self.fix}"


@dataclass
class NodeReport:
    """The findings weighed by the policy: failures stop the load, warnings are logged."""

    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NodeScene:
    """What the check needs to know about this agent and its node."""

    job_root: Path
    node: str
    agent_pid: int
    started: float
    env: Mapping[str, str]
    # Folders whose file system must have room: label -> folder (it may not exist yet).
    folders: Mapping[str, str]
    # GPUs this agent may use (indices or UUIDs), None for all; whether the role needs GPUs.
    visible_gpus: frozenset[str] | None = None
    uses_gpus: bool = False


def current_jobs(scene: NodeScene) -> dict[str, float] | None:
    """The Slurm jobs running on this node and when each began; None without Slurm."""
    if not scene.env.get("SLURM_JOB_ID") or not shutil.which("squeue", path=scene.env.get("PATH")):
        return None
    argv = ["squeue", "-h", "-t", "RUNNING", "-w", scene.node, "-o", "%i|%S"]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_S,
            env=dict(scene.env),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    jobs = {}
    for line in done.stdout.splitlines():
        job, _, start = line.strip().partition("|")
        try:
            jobs[job] = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            jobs[job] = time.time()
    return jobs


def _job_of(proc: psutil.Process) -> tuple[str, dict[str, str]] | None:
    """(the job folder a process belongs to, its environment), or None when not ours."""
    try:
        env = proc.environ()
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        return None
    if env.get(JOB_DIR_ENV):
        return env[JOB_DIR_ENV], env
    if "--job-dir" in cmdline[:-1] and "--role" in cmdline:
        value = cmdline[cmdline.index("--job-dir") + 1]
        try:
            return str(Path(proc.cwd(), value).resolve()), env
        except (psutil.Error, OSError):
            return value, env
    return None


def _over(job: str, env: Mapping[str, str], scene: NodeScene, jobs: dict[str, float] | None) -> str:
    """Why ``job`` is over ("" while it is not, or when it is not ours to judge)."""
    slurm_id = env.get("SLURM_JOB_ID")
    if slurm_id and jobs is not None:
        if env.get("SLURM_CONF") != scene.env.get("SLURM_CONF"):
            return ""  # another Slurm on this host (a test machine): not ours to judge
        return "" if slurm_id in jobs else f"its Slurm job {slurm_id} no longer runs on this node"
    try:
        state = json.loads((Path(job) / "status.json").read_text()).get("state")
    except FileNotFoundError:
        return f"its job directory {job} is gone" if not Path(job).exists() else ""
    except (OSError, ValueError, AttributeError):
        return ""
    return f"its job ({job}) is {state}" if state in ("stopped", "failed") else ""


def _own_tree(pid: int) -> set[int]:
    try:
        me = psutil.Process(pid)
        return {pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}
    except psutil.Error:
        return {pid}


def stale_processes(scene: NodeScene, jobs: dict[str, float] | None) -> list[Finding]:
    """Processes of an earlier job of ours still alive on this node."""
    own, ours = _own_tree(scene.agent_pid), str(scene.job_root)
    found = []
    for proc in psutil.process_iter(["pid", "name", "create_time"]):
        if proc.pid in own or (proc.info["create_time"] or 0) >= scene.started:
            continue
        owner = _job_of(proc)
        if owner is None or owner[0] == ours:
            continue
        why = _over(owner[0], owner[1], scene, jobs)
        if why:
            started = time.strftime("%H:%M:%S", time.localtime(proc.info["create_time"]))
            found.append(
                Finding(
                    "stale_processes",
                    f"pid {proc.pid} ({proc.info['name']}, started {started}) is still alive: "
                    f"{why}",
                    f"kill {proc.pid}   (kill -9 {proc.pid} if it stays)",
                    str(proc.pid),
                )
            )
    return found


def _open_under(folder: str) -> set[str]:
    """Files under ``folder`` some process has open or mapped (as far as /proc lets us see)."""
    prefix, used = folder.rstrip("/") + "/", set[str]()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                used.update(ln.split(None, 5)[-1].strip() for ln in maps if prefix in ln)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target)
        except OSError:
            continue
    return {u.removesuffix(" (deleted)") for u in used}


def stale_shm(scene: NodeScene, shm_dir: str, jobs: dict[str, float] | None) -> list[Finding]:
    """Engine shared-memory files older than the node's current jobs that nobody has open."""
    cutoff = min(jobs.values(), default=scene.started) if jobs else scene.started
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    candidates = []
    for name in names:
        if not any(fnmatch.fnmatch(name, pattern) for pattern in SHM_PATTERNS):
            continue
        path = os.path.join(shm_dir, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_mtime < cutoff:
            candidates.append((path, info))
    if not candidates:
        return []
    used = _open_under(shm_dir)
    found = []
    for path, info in candidates:
        if path in used:
            continue
        age_h = (time.time() - info.st_mtime) / 3600
        found.append(
            Finding(
                "stale_shm",
                f"{path} ({info.st_size / (1 << 20):.1f} MiB, last written {age_h:.1f} h ago, "
                "before the node's current jobs began; open by no process)",
                f"rm -f {path}",
                path,
            )
        )
    return found


def _existing(folder: str) -> Path | None:
    path = Path(folder)
    while not path.exists():
        if path.parent == path:
            return None
        path = path.parent
    return path


def disk_space(scene: NodeScene, min_free_gib: float) -> list[Finding]:
    """The scratch and weights folders' file systems, each below ``min_free_gib`` free."""
    found, seen = [], set()
    for label, folder in scene.folders.items():
        path = _existing(folder)
        if path is None:
            continue
        try:
            device = path.stat().st_dev
            free = shutil.disk_usage(path).free / GIB
        except OSError:
            continue
        if device in seen or free >= min_free_gib:
            continue
        seen.add(device)
        found.append(
            Finding(
                "disk",
                f"{folder} ({label}) has {free:.2f} GiB free on its file system, below "
                f"agent.preflight.min_free_disk_gib {min_free_gib:g}",
                f"du -xsh {path}/* | sort -h | tail   (free space there, or move the folder)",
            )
        )
    return found


def gpu_findings(
    scene: NodeScene, state: GpuState, stale: Iterable[Finding], min_free: float
) -> list[Finding]:
    """Others' processes on the GPUs, and GPUs short of free memory."""
    own = _own_tree(scene.agent_pid)
    ours_stale = {f.target for f in stale}
    found = []
    visible = [g for g in state.gpus if _visible(g.index, g.uuid, scene.visible_gpus)]
    for proc in state.processes:
        if proc.pid in own or not _visible(proc.gpu, proc.gpu, scene.visible_gpus):
            continue
        whose = "of an earlier job of ours" if str(proc.pid) in ours_stale else _user(proc.pid)
        found.append(
            Finding(
                "gpu_processes",
                f"pid {proc.pid} ({proc.name}, {whose}) holds {proc.used_mib:.0f} MiB on GPU "
                f"{proc.gpu}",
                f"ask its owner to end it, or kill {proc.pid} if it is yours ({state.tool} "
                "--query-compute-apps=pid,used_memory --format=csv lists them)",
                str(proc.pid),
            )
        )
    for gpu in visible:
        if gpu.free_fraction < min_free:
            found.append(
                Finding(
                    "gpu_processes",
                    f"GPU {gpu.index} has {gpu.total_mib - gpu.used_mib:.0f} of "
                    f"{gpu.total_mib:.0f} MiB free ({gpu.free_fraction:.0%}), below "
                    f"agent.preflight.min_free_gpu_memory {min_free:g}",
                    f"{state.tool} --query-compute-apps=pid,used_memory --format=csv shows who "
                    "holds it",
                )
            )
    return found


def _visible(index: str, uuid: str, visible: frozenset[str] | None) -> bool:
    return visible is None or index in visible or uuid in visible


def _user(pid: int) -> str:
    try:
        return f"user {psutil.Process(pid).username()}"
    except (psutil.Error, KeyError):
        return "another pid namespace or user"


def _kill(pid: str) -> str:
    proc = psutil.Process(int(pid))
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs([proc], timeout=CLEAN_GRACE_S)
    for left in alive:
        left.kill()
    return f"killed pid {pid}" + (" (SIGKILL after the grace)" if alive else "")


def _unlink(path: str) -> str:
    # Another agent on this node may have removed it first.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return f"removed {path}"


def _weigh(
    report: NodeReport,
    findings: list[Finding],
    policy: str,
    clean: Callable[[str], str] | None = None,
) -> None:
    for finding in findings:
        if policy == "fail":
            report.failures.append(finding)
        elif policy == "clean" and clean is not None and finding.target:
            try:
                report.cleaned.append(clean(finding.target))
            except (OSError, psutil.Error) as exc:
                report.warnings.append(
                    Finding(finding.check, f"{finding.what}; cleaning failed: {exc}", finding.fix)
                )
        else:
            report.warnings.append(finding)


def inspect_node(scene: NodeScene, policy: PreflightPolicy) -> NodeReport:
    """Every node check the policy asks for, weighed (and cleaned where it says ``clean``)."""
    report = NodeReport()
    jobs = current_jobs(scene)
    stale: list[Finding] = []
    if policy.stale_processes != "ignore":
        stale = stale_processes(scene, jobs)
        _weigh(report, stale, policy.stale_processes, _kill)
    if policy.gpu_processes != "ignore":
        state = read_gpus(scene.env)
        if state.note and (scene.uses_gpus or state.tool):
            report.notes.append(state.note)
        found = gpu_findings(scene, state, stale, policy.min_free_gpu_memory)
        _weigh(report, found, policy.gpu_processes)
    if policy.stale_shm != "ignore":
        _weigh(report, stale_shm(scene, policy.shm_dir, jobs), policy.stale_shm, _unlink)
    if policy.disk != "ignore":
        _weigh(report, disk_space(scene, policy.min_free_disk_gib), policy.disk)
    return report


async def check_node(
    scene: NodeScene, policy: PreflightPolicy, log: logging.Logger, who: str
) -> NodeReport:
    """``inspect_node`` off the event loop, every finding, note and cleaning logged."""
    report = await trio.to_thread.run_sync(inspect_node, scene, policy)
    for note in report.notes:
        log.info("%s: node check: %s", who, note)
    for done in report.cleaned:
        log.warning("%s: node check cleaned (agent.preflight): %s", who, done)
    for finding in report.warnings:
        log.warning("%s: node check: %s", who, finding.line())
    log.info(
        "%s: node checks (agent.preflight): %d failures, %d warnings, %d cleaned",
        who,
        len(report.failures),
        len(report.warnings),
        len(report.cleaned),
    )
    return report
