"""What the node's GPU tool says: the processes on each GPU and each GPU's free memory.

``nvidia-smi`` (NVIDIA) is asked in its CSV query form; on AMD nodes ``amd-smi`` (or the older
``rocm-smi``) is found and named, but its output is not read yet: the note says so. Every call is
bounded; a tool that fails or hangs becomes a note, never a failure of the node check.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

TOOL_TIMEOUT_S = 15.0
NVIDIA_SMI = "nvidia-smi"
AMD_TOOLS = ("amd-smi", "rocm-smi")
GPU_QUERY = ["--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
APPS_QUERY = [
    "--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
    "--format=csv,noheader,nounits",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU: its index, UUID, used and total memory (MiB)."""

    index: str
    uuid: str
    used_mib: float
    total_mib: float

    @property
    def free_fraction(self) -> float:
        """The part of its memory that is free (1.0 when the total is unknown)."""
        return 1.0 - self.used_mib / self.total_mib if self.total_mib > 0 else 1.0


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU as the tool reports it."""

    pid: int
    gpu: str
    used_mib: float
    name: str


@dataclass
class GpuState:
    """The tool's answer, or a note saying why there is none."""

    tool: str | None
    gpus: list[Gpu] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    note: str | None = None


def _number(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return 0.0


def _csv(text: str, columns: int) -> list[list[str]]:
    # The last column (a process name) may itself hold commas.
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",", columns - 1)]
        if len(cells) == columns and cells[0]:
            rows.append(cells)
    return rows


def parse_gpus(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,uuid,memory.used,memory.total`` CSV -> GPUs."""
    return [Gpu(r[0], r[1], _number(r[2]), _number(r[3])) for r in _csv(text, 4)]


def parse_processes(text: str, gpus: list[Gpu]) -> list[GpuProcess]:
    """``nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name`` -> processes
    (the GPU named by its index where the UUID is known)."""
    index = {g.uuid: g.index for g in gpus}
    out = []
    for pid, uuid, used, name in _csv(text, 4):
        if pid.isdigit():
            out.append(GpuProcess(int(pid), index.get(uuid, uuid), _number(used), name))
    return out


def _run(argv: list[str], env: Mapping[str, str]) -> str:
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if done.returncode != 0:
        raise OSError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}")
    return done.stdout


def read_gpus(env: Mapping[str, str]) -> GpuState:
    """Ask the node's GPU tool (found on ``env``'s PATH)."""
    path = env.get("PATH")
    tool = shutil.which(NVIDIA_SMI, path=path)
    if tool is None:
        amd = next((t for t in AMD_TOOLS if shutil.which(t, path=path)), None)
        if amd is not None:
            return GpuState(
                amd,
                note=f"{amd} is on PATH but its process list is not read yet: check GPU "
                f"processes by hand ({amd} process / rocm-smi --showpids)",
            )
        return GpuState(
            None,
            note="neither nvidia-smi nor amd-smi/rocm-smi is on PATH: GPU processes and free "
            "GPU memory are not checked",
        )
    try:
        gpus = parse_gpus(_run([tool, *GPU_QUERY], env))
        processes = parse_processes(_run([tool, *APPS_QUERY], env), gpus)
    except subprocess.TimeoutExpired:
        return GpuState(tool, note=f"{tool} did not answer within {TOOL_TIMEOUT_S:g}s")
    except OSError as exc:
        return GpuState(tool, note=f"{tool} failed: {exc}")
    return GpuState(tool, gpus, processes)
