"""An engine's supervision policy: probe cadence, restarts and budgets, from the plan.

Kept apart from the supervisor (``agent.node.supervisor``) so the agent and the head build one
without reading the state machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.job.plan import Plan


@dataclass(frozen=True)
class Policy:
    """Probe cadence, restart policy and budgets for one engine.

    The agent's settings keep the plan's names (``plan.agent``, agent.job.plan.AgentPlan), which
    are the recipe's ``agent.probe.*`` and ``agent.restart.*`` keys joined by ``_`` (``restart_max``
    is ``agent.restart.max_restarts``): one name each from the plan to here.
    """

    probe_startup_interval_s: float
    probe_interval_s: float
    probe_timeout_s: float
    probe_failure_threshold: int
    restart_backoff_initial_s: float
    restart_backoff_max_s: float
    restart_max: int
    restart_window_s: float
    # The role's (plan.prefill / plan.decode / plan.router).
    startup_budget_s: float
    stop_grace_s: float
    # A progress line in the engine's log keeps its startup going this much longer (past the
    # budget), up to ``startup_max_s`` since launch (docs/agent.md "Startup deadlines").
    startup_silence_s: float = 900.0
    startup_max_s: float = 14400.0


def policy_for(plan: Plan, *, startup_budget_s: float, stop_grace_s: float) -> Policy:
    """The supervisor policy of one engine, from the plan's agent settings."""
    a = plan.agent
    return Policy(
        probe_startup_interval_s=a.probe_startup_interval_s,
        probe_interval_s=a.probe_interval_s,
        probe_timeout_s=a.probe_timeout_s,
        probe_failure_threshold=a.probe_failure_threshold,
        restart_backoff_initial_s=a.restart_backoff_initial_s,
        restart_backoff_max_s=a.restart_backoff_max_s,
        restart_max=a.restart_max,
        restart_window_s=a.restart_window_s,
        startup_budget_s=startup_budget_s,
        stop_grace_s=stop_grace_s,
        startup_silence_s=a.startup_silence_s,
        startup_max_s=max(a.startup_max_s, startup_budget_s),
    )
