"""The log file layout of a job: which file holds whose lines, and their rotated backups.

One home for it, so that ``tilert-submit logs``, the agent's ``/logs`` endpoint and the log pump
agree on every path. Engine logs (``engine.log``, ``router.log``, ``benchmark.log``) live in
``J/logs/<name>/``, or, with ``agent.logs.location: node``, on each node's own disk in
``<agent.logs.node_dir>/<job folder name>/<name>/`` (then only that node's agent can read them, and
serves them on ``/logs``). The agents' own ``agent.log`` always stays in ``J/logs/<name>/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.job.names import (
    BENCHMARK_NAME,
    HEAD_NAME,
    ROUTER_NAME,
    agent_sort_key,
    parse_agent_name,
)
from agent.job.paths import PRIVATE_DIR_MODE, JobDir
from agent.job.plan import Plan

ENGINE_LOG = "engine.log"
ROUTER_LOG = "router.log"
AGENT_LOG = "agent.log"
# The weight converter's output, in the folder of the decode agent that ran it. As a log source
# it is named ``<agent>:convert`` (``tilert-submit logs J decode-0:convert``).
CONVERT_LOG = "convert.log"
CONVERT_SOURCE_SUFFIX = ":convert"
BENCHMARK_LOG = "benchmark.log"
# Rotation when the recipe says nothing (agent.logs.max_bytes / backups): one home, read by the
# recipe's defaults and by the agent's own log before it has a plan.
DEFAULT_LOG_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_LOG_BACKUPS = 3
# A node's log folder is shared by every user's jobs, like /tmp (each job's folder is 0700).
NODE_DIR_MODE = 0o1777


def rotated_files(path: Path) -> list[Path]:
    """The rotated backups of ``path`` that exist, oldest first (``path.N`` ... ``path.1``)."""
    found = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            found.append((int(suffix), candidate))
    return [p for _, p in sorted(found, reverse=True)]


def node_local(plan: Plan | None) -> bool:
    """Whether the plan keeps engine logs on each node's disk (``agent.logs.location: node``)."""
    return plan is not None and plan.agent.log_node_dir is not None


def engine_log_root(job: JobDir, plan: Plan | None = None) -> Path:
    """The folder that holds the engine log folders: ``J/logs``, or the node-local one."""
    if plan is None or plan.agent.log_node_dir is None:
        return job.logs
    return Path(plan.agent.log_node_dir) / job.root.name


def log_path(job: JobDir, name: str, *, agent: bool = False, plan: Plan | None = None) -> Path:
    """The current log file of ``name`` (``prefill-0``, ``decode-1``, ``router``, ``benchmark``).

    Without ``plan`` the engine logs are taken to be in the job directory (the default layout).
    """
    if name.endswith(CONVERT_SOURCE_SUFFIX) and not agent:
        return convert_log_path(job, name.removesuffix(CONVERT_SOURCE_SUFFIX))
    if agent:
        if name in (ROUTER_NAME, BENCHMARK_NAME):
            raise ValueError(f"the {name} has no agent.log of its own: see {HEAD_NAME}'s")
        return job.log_dir(name) / AGENT_LOG
    root = engine_log_root(job, plan)
    # The router is supervised by the head agent, so its log lives in the head's folder.
    if name == ROUTER_NAME:
        return root / HEAD_NAME / ROUTER_LOG
    if name == BENCHMARK_NAME:
        return root / BENCHMARK_NAME / BENCHMARK_LOG
    return root / name / ENGINE_LOG


def make_log_dir(job: JobDir, name: str, plan: Plan | None = None) -> Path:
    """Create the folder of ``name``'s engine log (mode 0700) and, for node-local logs, the
    node's folder (1777 when this creates it) and the job's (0700); returns the folder."""
    folder = log_path(job, name, plan=plan).parent
    if node_local(plan):
        root = folder.parent.parent
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, NODE_DIR_MODE)
        folder.parent.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(folder, PRIVATE_DIR_MODE)
    return folder


def log_files(job: JobDir, *, agent: bool = False) -> dict[str, Path]:
    """``{name: current log file}`` for agents whose folders exist in ``J/logs``: prefill-0,
    decode-0.., router, and the benchmark once its folder exists.

    With ``agent`` the files are the agents' own ``agent.log`` (the router has none of its own).
    """
    try:
        entries = [p.name for p in job.logs.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return {}
    names = sorted((n for n in entries if parse_agent_name(n)), key=agent_sort_key)
    files = {name: log_path(job, name, agent=agent) for name in names}
    if not agent and HEAD_NAME in files:
        files[ROUTER_NAME] = log_path(job, ROUTER_NAME)
    if not agent:
        for name in names:
            if convert_log_path(job, name).exists():
                files[name + CONVERT_SOURCE_SUFFIX] = convert_log_path(job, name)
    if not agent and BENCHMARK_NAME in entries:
        files[BENCHMARK_NAME] = log_path(job, BENCHMARK_NAME)
    return files


def convert_log_path(job: JobDir, name: str) -> Path:
    """The weight converter's log of agent ``name`` (a decode agent)."""
    return job.log_dir(name) / CONVERT_LOG
