"""The head's decisions, as plain functions over what it knows at one moment (a ``JobView``).

May the router start (``gate``), which decode to drop (``to_drop``) or take back once healthy
again (``to_rejoin``, bounded per decode: one that flaps stays out, ``held_out``), which decode
to take out of the router's list while its engine is down (``to_rest``) and put back once healthy
(``to_wake``), which decodes the router's list holds (``router_list``: the one definition of it),
can the job still serve (``fatal``), must a canary prove it again (``proof_due``: after any
restart), which state to show while serving (``serving_state``: ``ready`` only once proven). No
processes, sockets or clocks here (the caller passes ``now``), so tests/test_head.py drives every
decision with data.

"Degrade, don't die": a failed decode is dropped and the job goes on without it; the job fails only
when the prefill, the router or every decode has failed, or when the agents cannot work together
(different tilert versions). A bad file in the rendezvous folder makes at most its agent failed
(``agent.head.peers``), never the job.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from agent.errors import RuntimeFailure
from agent.job.names import HEAD_NAME, ROUTER_NAME, parse_agent_name
from agent.job.records import JobAgent
from agent.job.vocab import AgentState, JobState


class JobFailed(RuntimeFailure):
    """The job cannot serve; the message names the agent, the reason and its log."""


@dataclass(frozen=True)
class JobView:
    """What the head knows at one moment, as plain data: the input of every decision."""

    # Every agent the job expects (the head first), as status.json shows it: state, node, reason,
    # log.
    agents: Mapping[str, JobAgent]
    # The time (trio's clock) the head saw each agent turn healthy.
    healthy_since: Mapping[str, float | None] = field(default_factory=dict)
    # When each agent turned healthy on its own (wall) clock, as its /status says (healthy_at).
    healthy_at: Mapping[str, float | None] = field(default_factory=dict)
    # The tilert version each agent's record names (agents whose preflight found one).
    versions: Mapping[str, str] = field(default_factory=dict)
    # The router once started (its row in status.json).
    router: JobAgent | None = None

    def state(self, name: str) -> AgentState:
        """The state of agent ``name`` as the head sees it (``missing``, ``unreachable``, ...)."""
        return self.agents[name].state

    @cached_property
    def decodes(self) -> list[str]:
        """The decode agents, in listing order (found once per view: decisions ask often)."""
        return [n for n in self.agents if (p := parse_agent_name(n)) and p[0] == "decode"]


def failure_of(agent: JobAgent) -> str:
    """A failed agent as an error names it: where, why, and its log."""
    return f"{agent.name} on {agent.node or '?'} failed: {agent.reason} (log: {agent.log})"


def live_workers(view: JobView) -> list[str]:
    """The head and every decode that has not failed (a failed one is dropped, not waited for)."""
    return [HEAD_NAME, *(n for n in view.decodes if view.state(n) != "failed")]


def gate(view: JobView, now: float) -> float | None:
    """When every live worker is healthy: the time the last one turned healthy; else None.

    An agent whose turn to healthy was not seen counts as healthy ``now``.
    """
    names = live_workers(view)
    if any(view.state(n) != "healthy" for n in names):
        return None
    return max(view.healthy_since.get(n) or now for n in names)


def last_healthy(view: JobView) -> tuple[str, float] | None:
    """The live worker that turned healthy last on its own clock, and when; None if one is mute."""
    times = [(view.healthy_at.get(n), n) for n in live_workers(view)]
    if any(at is None for at, _ in times):
        return None
    at, name = max((at, n) for at, n in times if at is not None)
    return name, at


def waiting_for(view: JobView) -> str:
    """The agents the gate still waits for, with their states (the reason of ``waiting``)."""
    return ", ".join(f"{n} ({a.state})" for n, a in view.agents.items() if a.state != "healthy")


def converting(view: JobView) -> bool:
    """Whether a worker is converting its weights (not late: the conversion has its own budget,
    ``agent.convert_budget_s``, which the decode agent enforces)."""
    return any(a.state == "converting" for a in view.agents.values())


def startup_overrun(view: JobView, budget_s: float) -> str:
    """The error once the startup budget is spent: each late agent with its reason and its log."""
    # Users act on these, not on a folder.
    late = [a for a in view.agents.values() if a.state != "healthy"]
    return f"still waiting after the startup budget of {budget_s:g}s: " + "; ".join(
        f"{a.name} on {a.node or '?'} {a.state}: {a.reason} (log: {a.log})" for a in late
    )


def to_drop(view: JobView, dropped: Collection[str]) -> list[str]:
    """The decodes that failed and are not dropped yet (never the prefill: its failure is fatal)."""
    return [n for n in view.decodes if view.state(n) == "failed" and n not in dropped]


# A decode in these states has an agent that knows its engine is down (restarting after a crash,
# starting again, failing its probes) or cannot be asked (its agent not answering, probably dead
# with its engine): TileRT's router would still hand it requests.
DOWN_STATES = frozenset({"restarting", "starting", "unhealthy", "unreachable"})


def down_decodes(view: JobView, in_router: Collection[str]) -> list[str]:
    """The decodes of the router's list (``in_router``) that are down now."""
    return [n for n in view.decodes if n in in_router and view.state(n) in DOWN_STATES]


def to_rest(
    down_since: Mapping[str, float],
    in_router: Sequence[str],
    now: float,
    after_s: float | None,
) -> list[str]:
    """The decodes to take out of the router's list now (``agent.down_decode_out_after_s``):
    down for ``after_s`` (None: never), never every one (a router needs a decode; requests then
    wait for one at the front)."""
    if after_s is None:
        return []
    due = [n for n in in_router if n in down_since and now - down_since[n] >= after_s]
    return due if len(due) < len(in_router) else due[: len(in_router) - 1]


def router_list(
    members: Sequence[str], dropped: Collection[str], resting: Collection[str]
) -> list[str]:
    """The router's decode list: the pool's members (in listing order) neither dropped (failed)
    nor resting (down for a while; ``to_rest``). The one definition of the list: the router's
    command is built from it, the front door asks it whether the pool is whole."""
    return [n for n in members if n not in dropped and n not in resting]


def to_wake(view: JobView, resting: Collection[str]) -> list[str]:
    """The decodes out of the router's list while down that are healthy again."""
    return [n for n in view.decodes if n in resting and view.state(n) == "healthy"]


def to_rejoin(
    view: JobView, dropped: Collection[str], rejoins: Mapping[str, int], max_rejoins: int
) -> list[str]:
    """The dropped decodes healthy again that may come back: each within ``max_rejoins``
    (``agent.max_rejoins``; ``rejoins`` counts how often each came back already)."""
    return [
        n
        for n in view.decodes
        if n in dropped and view.state(n) == "healthy" and rejoins.get(n, 0) < max_rejoins
    ]


def held_out(
    view: JobView, dropped: Collection[str], rejoins: Mapping[str, int], max_rejoins: int
) -> dict[str, str]:
    """The dropped decodes healthy again that stay out (they flapped past ``max_rejoins``), with
    why."""
    return {
        n: (
            f"healthy again but kept out of the router: it was taken back {rejoins.get(n, 0)} "
            f"time(s) and failed again, the limit of agent.max_rejoins ({max_rejoins}); restart "
            "the job to use it again"
        )
        for n in view.decodes
        if n in dropped and view.state(n) == "healthy" and rejoins.get(n, 0) >= max_rejoins
    }


def version_mismatch(versions: Mapping[str, str]) -> str | None:
    """Why the agents' tilert versions cannot work together, or None (the head's is the
    reference)."""
    prefill = versions.get(HEAD_NAME)
    if not prefill:
        return None
    for name, version in versions.items():
        if version != prefill:
            return (
                f"tilert versions differ: {HEAD_NAME} has tilert {prefill}, {name} has "
                f"tilert {version}; the control protocol needs the same version on both sides: "
                "use matching prefill and decode images"
            )
    return None


def fatal(view: JobView) -> str | None:
    """Why the job can no longer serve, or None while it can."""
    if view.state(HEAD_NAME) == "failed":
        return failure_of(view.agents[HEAD_NAME])
    decodes = view.decodes
    failed = [n for n in decodes if view.state(n) == "failed"]
    if len(failed) == len(decodes):
        return "every decode worker failed: " + "; ".join(
            failure_of(view.agents[n]) for n in failed
        )
    if view.router is not None and view.router.state == "failed":
        return f"router failed: {view.router.reason} (log: {view.router.log})"
    return version_mismatch(view.versions)


def unhealthy(view: JobView, dropped: Collection[str]) -> list[str]:
    """What the serving job misses: each agent it uses that is not healthy, and the router."""
    out = [n for n, a in view.agents.items() if n not in dropped and a.state != "healthy"]
    if view.router is not None and view.router.state != "healthy":
        out.append(f"router ({view.router.state})")
    return out


def restart_marks(view: JobView) -> dict[str, int]:
    """Each agent's restart count, and the router's: a change means something restarted."""
    marks = {name: agent.restarts for name, agent in view.agents.items()}
    if view.router is not None:
        marks[ROUTER_NAME] = view.router.restarts
    return marks


def proof_due(view: JobView, dropped: Collection[str], proven: Mapping[str, int] | None) -> bool:
    """Whether a canary must run now: something restarted since the last one passed (``proven``
    holds the restart marks of then) and everything the job uses is healthy again."""
    return restart_marks(view) != proven and not unhealthy(view, dropped)


def serving_state(
    view: JobView, dropped: Collection[str], *, proven: bool = True, proof: str = ""
) -> tuple[JobState, str]:
    """The job's state while it serves, and why: ``ready`` only when nothing is missing and a
    canary passed through the router since the last restart (``proven``; ``proof`` says where
    the next one stands)."""
    missing = unhealthy(view, dropped)
    if missing or dropped or not proven:
        reasons = missing + [f"{n} dropped" for n in dropped]
        if not missing and not proven:
            reasons.append(proof or "healthy again; waiting for a canary through the router")
        return "degraded", ", ".join(reasons)
    return "ready", "every worker and the router healthy"
