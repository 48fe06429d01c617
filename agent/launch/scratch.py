"""Engine scratch space: each process's own temp and cache folders, removed when its agent stops.

vLLM, torch and triton write what they cache (compiled graphs, ~150 MB for a tiny model) and
vLLM its ZMQ socket files wherever ``TMPDIR`` and the cache variables point: by default the node's
shared ``/tmp`` and ``~/.cache``, where they outlive the job. So every engine (and the router) gets
one folder under the agent's scratch root and every variable below points into it; the agent
removes the root when it stops (docs/agent.md, "Scratch space").

The root (``agent.scratch_dir``): by default a per-job folder under the node's system temp folder,
``job`` for the job directory, or a node-local path. A variable the recipe sets for the role wins.
Paths are kept short: vLLM's socket files must fit in a Unix socket path (``socket_path_problem``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from agent.job.paths import JobDir

# Variable -> folder inside the process's scratch folder. TMPDIR also moves vLLM's ZMQ sockets
# (VLLM_RPC_BASE_PATH defaults to the temp folder) and Python's tempfile.
SCRATCH_ENV = {
    "TMPDIR": "tmp",
    "XDG_CACHE_HOME": "cache",
    "VLLM_CACHE_ROOT": "cache/vllm",
    "TORCHINDUCTOR_CACHE_DIR": "cache/torchinductor",
    "TRITON_CACHE_DIR": "cache/triton",
    "CUDA_CACHE_PATH": "cache/nv",
}
SCRATCH_MODE = 0o700
# vLLM names its ZMQ sockets ``$TMPDIR/<uuid4>`` (37 more characters), and a Unix socket path
# holds at most 107: a deeper TMPDIR makes vLLM fail at startup with a ZMQError.
SOCKET_PATH_MAX = 107
SOCKET_NAME_LEN = 37


def hub_home(agent_env: Mapping[str, str]) -> str:
    """Where the Hugging Face cache is without our XDG_CACHE_HOME: downloaded weights stay
    shared."""
    if agent_env.get("HF_HOME"):
        return agent_env["HF_HOME"]
    xdg = agent_env.get("XDG_CACHE_HOME") or os.path.join(
        agent_env.get("HOME") or os.path.expanduser("~"), ".cache"
    )
    return os.path.join(xdg, "huggingface")


def scratch_env(
    folder: str, role_env: Mapping[str, str], agent_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables that point a process's temp and caches into ``folder`` (recipe's win)."""
    env = {
        name: os.path.join(folder, sub) for name, sub in SCRATCH_ENV.items() if name not in role_env
    }
    if "XDG_CACHE_HOME" in env and "HF_HOME" not in role_env:
        # Moving XDG_CACHE_HOME would move the hub cache too, and download the weights again.
        env["HF_HOME"] = hub_home(agent_env)
    return env


def scratch_root(job: JobDir, where: str | None, *, temp_dir: str | None = None) -> Path:
    """This job's scratch root on this node for the setting ``agent.scratch_dir``."""
    if where == "job":
        return job.root / "scratch"
    # A hash of the job folder's full path: two jobs never share a root, and the name is short
    # (vLLM's socket paths must fit, see SOCKET_PATH_MAX).
    digest = hashlib.sha256(str(job.root.absolute()).encode()).hexdigest()[:10]
    parent = Path(where) if where else Path(temp_dir or tempfile.gettempdir())
    return parent / f"tilert-{digest}"


def socket_path_problem(env: Mapping[str, str]) -> str | None:
    """Why vLLM could not make its ZMQ sockets in ``env``'s TMPDIR (too long a path), or None."""
    tmp = env.get("TMPDIR", "")
    if len(tmp) + SOCKET_NAME_LEN <= SOCKET_PATH_MAX:
        return None
    return (
        f"the engine's TMPDIR {tmp} is {len(tmp)} characters long: vLLM puts its ZMQ sockets "
        f"there ({SOCKET_NAME_LEN} more characters) and a socket path holds at most "
        f"{SOCKET_PATH_MAX}; set agent.scratch_dir to a shorter node-local path (or TMPDIR in the "
        "role's env)"
    )


class Scratch:
    """One agent's scratch folder: a sub-folder per process, all removed by ``remove``."""

    def __init__(self, root: Path, agent: str) -> None:
        self.root = root
        self.path = root / agent

    def folder(self, process: str) -> str:
        """The scratch folder of ``process`` (made now, with every variable's sub-folder)."""
        folder = self.path / process
        for sub in SCRATCH_ENV.values():
            (folder / sub).mkdir(parents=True, exist_ok=True)
        for made in (self.root, self.path, folder):
            with contextlib.suppress(OSError):
                os.chmod(made, SCRATCH_MODE)
        return str(folder)

    def remove(self) -> None:
        """Remove this agent's folder, and the job's root once no other agent uses it."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()  # only when empty: other agents of the job on this node
