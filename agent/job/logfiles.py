"""The log file layout of a job: which file holds whose lines, and their rotated backups.

One home for it, so that ``tilert-submit logs``, the agent's ``/logs`` endpoint and the log pump
agree on every path.
"""

from __future__ import annotations

from pathlib import Path

from agent.job.names import (
    BENCHMARK_NAME,
    HEAD_NAME,
    ROUTER_NAME,
    agent_sort_key,
    parse_agent_name,
)
from agent.job.paths import JobDir

ENGINE_LOG = "engine.log"
ROUTER_LOG = "router.log"
AGENT_LOG = "agent.log"
# The weight converter's output, in the folder of the decode agent that ran it. As a log source
# it is named ``<agent>:convert`` (``tilert-submit logs J decode-0:convert``).
CONVERT_LOG = "convert.log"
CONVERT_SOURCE_SUFFIX = ":convert"
# The benchmark client's output, every level one after the other, in J/logs/benchmark/.
BENCHMARK_LOG = "benchmark.log"


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
    if name.endswith(CONVERT_SOURCE_SUFFIX) and not agent:
        return convert_log_path(job, name.removesuffix(CONVERT_SOURCE_SUFFIX))
    # The router is supervised by the head agent, so its log lives in the head's folder.
    if name == ROUTER_NAME:
        if agent:
            raise ValueError("the router has no agent.log of its own: see prefill-0's")
        return job.log_dir(HEAD_NAME) / ROUTER_LOG
    if name == BENCHMARK_NAME:
        if agent:
            raise ValueError("the benchmark client has no agent.log of its own: see prefill-0's")
        return job.log_dir(BENCHMARK_NAME) / BENCHMARK_LOG
    return job.log_dir(name) / (AGENT_LOG if agent else ENGINE_LOG)


def log_files(job: JobDir, *, agent: bool = False) -> dict[str, Path]:
    """``{name: current log file}`` for agents whose folders exist: prefill-0, decode-0.., router,
    and the benchmark client once it ran.

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
        if BENCHMARK_NAME in entries:
            files[BENCHMARK_NAME] = log_path(job, BENCHMARK_NAME)
    return files


def convert_log_path(job: JobDir, name: str) -> Path:
    """The weight converter's log of agent ``name`` (a decode agent)."""
    return job.log_dir(name) / CONVERT_LOG
