"""The job's words, typed: roles and the states of engines, agents, the job and its benchmark.

Each vocabulary has its home here, as a ``Literal`` type (mypy checks every comparison against
it; msgspec checks every decoded record and view against it) and, where code lists the words, a
tuple of them in the order users see. The meanings are documented in docs/agent.md (the states an
agent and the head show) and docs/benchmark.md (the benchmark's).
"""

from __future__ import annotations

from typing import Literal, get_args

# The two roles a node plays; the router is supervised by prefill-0, it is not a role of its own.
Role = Literal["prefill", "decode"]
# Prefill first: the order of every listing (status table, logs, plan printout).
ROLES: tuple[Role, ...] = get_args(Role)
# A process of the job that status.json shows as a row, or a stand-in can replace: a role's
# engine or the router.
Process = Literal["prefill", "decode", "router"]
PROCESSES: tuple[Process, ...] = get_args(Process)

# The supervised state of one engine, in an agent's ``/status``. ``converting``: a decode agent
# waits for its weights folder to be converted (by itself or by another agent holding the folder's
# lock) before it starts its engine.
EngineState = Literal[
    "converting", "starting", "healthy", "unhealthy", "restarting", "failed", "stopping", "stopped"
]
# An agent's last word in its rendezvous record.
ExitState = Literal["failed", "stopped"]
# An agent as the head sees it (a row of status.json): its engine's state, or ``missing`` (no
# record yet), ``unreachable`` (not answering its ``/status``); ``pending`` until the job starts.
AgentState = Literal[EngineState, "missing", "unreachable", "pending"]

# The job's state in status.json.
JobState = Literal[
    "pending", "starting", "waiting", "ready", "degraded", "stopping", "stopped", "failed"
]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
# The states in which a job's processes run and refresh status.json.
LIVE_STATES: tuple[JobState, ...] = ("starting", "waiting", "ready", "degraded", "stopping")
# The states in which the router serves.
SERVING_STATES: tuple[JobState, ...] = ("ready", "degraded")

# The benchmark's state in status.json, and its verdict once it ended.
BenchmarkState = Literal["pending", "running", "passed", "failed"]
BenchmarkVerdict = Literal["passed", "failed"]


def as_role(text: str) -> Role:
    """``text`` as a role; ValueError when it is not one."""
    for role in ROLES:
        if text == role:
            return role
    raise ValueError(f"not a role: {text!r} (one of {', '.join(ROLES)})")
