"""The log file layout of a job: which file holds whose lines, and their rotated backups.

One home for it, so that ``tilert-submit logs``, the agent's ``/logs`` endpoint and the log pump
agree on every path.
"""

from __future__ import annotations

from pathlib import Path

from agent.job.paths import JobDir
from agent.job.records import ROUTER_NAME

ENGINE_LOG = "engine.log"
ROUTER_LOG = "router.log"
AGENT_LOG = "agent.log"
# The router is supervised by the head agent, so its log lives in the head's folder.
ROUTER_LOG_OWNER = "prefill-0"
ROLE_ORDER = ("prefill", "decode")


def rotated_files(path: Path) -> list[Path]:
    """The rotated backups of ``path`` that exist, oldest first (``path.N`` ... ``path.1``)."""
    found = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            found.append((int(suffix), candidate))
    return [p for _, p in sorted(found, reverse=True)]


def log_path(job: JobDir, name: str, *, agent: bool = False) -> Path:
    """The current log file of ``name`` (``prefill-0``, ``decode-1``, ``router``)."""
    if name == ROUTER_NAME:
        if agent:
            raise ValueError("the router has no agent.log of its own: see prefill-0's")
        return job.log_dir(ROUTER_LOG_OWNER) / ROUTER_LOG
    return job.log_dir(name) / (AGENT_LOG if agent else ENGINE_LOG)


def _agent_sort_key(name: str) -> tuple[int, int, str] | None:
    """Sort key for an agent folder name (prefill first, then by index); None when not an agent."""
    role, _, index = name.rpartition("-")
    if role not in ROLE_ORDER or not index.isdigit():
        return None
    return ROLE_ORDER.index(role), int(index), name


def log_files(job: JobDir, *, agent: bool = False) -> dict[str, Path]:
    """``{name: current log file}`` for agents whose folders exist: prefill-0, decode-0.., router.

    With ``agent`` the files are the agents' own ``agent.log`` (the router has none of its own).
    """
    try:
        entries = [p.name for p in job.logs.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return {}
    keyed = sorted(k for k in map(_agent_sort_key, entries) if k is not None)
    files = {name: log_path(job, name, agent=agent) for _, _, name in keyed}
    if not agent and ROUTER_LOG_OWNER in files:
        files[ROUTER_NAME] = log_path(job, ROUTER_NAME)
    return files
