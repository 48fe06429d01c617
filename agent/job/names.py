"""The names of a job's processes, built and parsed in one place.

Agents are ``prefill-0``, ``decode-0``, ``decode-1``, ...; the router is ``router``. The head agent
(the one that gates and runs the router) is always ``prefill-0``. Users type these names
(``tilert-submit logs J decode-1``), folders and records are named after them.
"""

from __future__ import annotations

from collections.abc import Iterator

from agent.job.vocab import ROLES, Role

ROUTER_NAME = "router"
# The benchmark the head runs once the job is ready (its log: ``logs J benchmark``).
BENCHMARK_NAME = "benchmark"


def agent_name(role: Role, index: int) -> str:
    """The public name of an agent: ``prefill-0``, ``decode-1``."""
    return f"{role}-{index}"


HEAD_NAME = agent_name("prefill", 0)


def parse_agent_name(name: str) -> tuple[Role, int] | None:
    """``decode-1`` -> ``("decode", 1)``; None for anything that is not an agent's name."""
    role, sep, index = name.rpartition("-")
    # ASCII digits only: "²" is a digit to str.isdigit() but not to int().
    if not sep or not (index.isascii() and index.isdigit()) or str(int(index)) != index:
        return None
    for known in ROLES:
        if role == known:
            return known, int(index)
    return None


def agent_sort_key(name: str) -> tuple[int, int]:
    """Prefill before decode, then by index; for names that ``parse_agent_name`` accepts."""
    parsed = parse_agent_name(name)
    if parsed is None:
        raise ValueError(f"not an agent name: {name!r}")
    return ROLES.index(parsed[0]), parsed[1]


def agent_names(prefill: int, decode: int) -> Iterator[str]:
    """Every agent of a job with ``prefill`` and ``decode`` nodes, in listing order."""
    for role, count in zip(ROLES, (prefill, decode), strict=True):
        for index in range(count):
            yield agent_name(role, index)
