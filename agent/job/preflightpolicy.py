"""The node preflight's policy (recipe ``agent.preflight``, carried in the plan as is).

What each finding of the node checks does (docs/preflight.md): ``fail`` stops the agent before the
load with the finding and its cleanup command, ``warn`` logs the same and goes on, ``ignore`` does
not look. ``clean`` (stale processes and ``/dev/shm`` files only) removes what was found and says
so: nothing is killed or deleted without that explicit setting.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Policy = Literal["fail", "warn", "ignore"]
CleanPolicy = Literal["fail", "warn", "ignore", "clean"]
FlagPolicy = Literal["check", "warn", "off"]

# Where a job's engines keep their shared-memory files: vLLM, NCCL and torch write there.
DEFAULT_SHM_DIR = "/dev/shm"


class PreflightPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """``agent.preflight``: the node checks before the load, each finding's weight."""

    # Recipe flags each engine program does not list in its own --help: refused (check), logged
    # (warn), or not asked for (off).
    engine_flags: FlagPolicy = "check"
    # Where the engines' flag lists are cached per image and version; None: $TILERT_FLAG_CACHE,
    # else $XDG_CACHE_HOME/tilert-agent/engine-flags (~/.cache/... without it).
    flag_cache_dir: str | None = None
    # The bound on one `--help` (vLLM imports for 10-60 s before it prints).
    flag_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 300.0
    # Processes of an earlier job of ours still alive on the node.
    stale_processes: CleanPolicy = "warn"
    # GPU processes of others, and GPUs with less free memory than min_free_gpu_memory.
    gpu_processes: Policy = "warn"
    # The fraction of each GPU's memory that must be free before the load.
    min_free_gpu_memory: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.9
    # vLLM, NCCL and torch files in shm_dir older than the node's current jobs.
    stale_shm: CleanPolicy = "warn"
    shm_dir: str = DEFAULT_SHM_DIR
    # Free space in the scratch and weights folders below min_free_disk_gib.
    disk: Policy = "fail"
    min_free_disk_gib: Annotated[float, msgspec.Meta(ge=0, le=1_000_000)] = 1.0
