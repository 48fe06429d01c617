"""How an engine's generation ended or must end, in words: its exit, its startup deadline passed,
"address in use" in its own lines, a health port answered by another process.

Functions of what the supervisor knows (the process, its policy, its log watch, its recent
lines); the supervisor (``agent.node.supervisor``) acts on them.
"""

from __future__ import annotations

import re
import signal

import psutil

from agent.launch import ProcessHandle
from agent.node.enginewatch import EngineWatch
from agent.node.policy import Policy

ADDRESS_IN_USE = re.compile(r"address already in use|errno 98|eaddrinuse", re.IGNORECASE)


def generation_note(name: str, generation: int) -> str:
    """The start of the marker line of a generation's start in the engine's log."""
    return f"=== {name} generation {generation} started"


def ended(code: int) -> str:
    """How a process ended, in words: ``exited with code 1``, ``killed by signal 9 (SIGKILL)``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    return f"killed by signal {-code}{name}"


def exit_reason(engine: ProcessHandle) -> str:
    """Why the engine's generation ended, from its exit (an exit 0 is no success for a server)."""
    code = engine.returncode
    if code is not None and code < 0:
        return f"engine pid {engine.pid} {ended(code)}"
    if code == 0:
        return f"engine pid {engine.pid} exited with code 0 (an engine must not exit while serving)"
    return f"engine pid {engine.pid} exited with code {code}"


def startup_over(
    policy: Policy, watch: EngineWatch | None, start: float, now: float, health_url: str
) -> str | None:
    """Why the startup wait ends now (a fatal log line, or past its deadline), or None.

    The deadline is the budget, moved on by ``startup_silence_s`` from each progress line,
    never past ``startup_max_s`` (docs/agent.md "Startup deadlines that watch progress").
    """
    if watch is not None and watch.fatal is not None:
        return f"its log shows a fatal error: {watch.fatal.line.strip()[:200]}"
    deadline = start + policy.startup_budget_s
    last = watch.progress_trio if watch is not None else None
    if last is not None:
        deadline = min(max(deadline, last + policy.startup_silence_s), start + policy.startup_max_s)
    if now <= deadline:
        return None
    if last is None:
        return (
            f"not healthy within the startup budget of {policy.startup_budget_s:g}s "
            f"({health_url}), and no progress line in its log; raise "
            "agent.startup_budget_s or health_check"
        )
    text = watch.progress if watch is not None else None
    if now > start + policy.startup_max_s:
        return (
            f"still starting after agent.startup_max_s ({policy.startup_max_s:g}s); last "
            f"progress {now - last:.0f}s ago: {text!r}"
        )
    return (
        f"no progress line for {now - last:.0f}s (agent.startup_silence_s "
        f"{policy.startup_silence_s:g}) after the startup budget of "
        f"{policy.startup_budget_s:g}s; last progress: {text!r}; raise "
        "agent.startup_silence_s or agent.startup_budget_s"
    )


def address_in_use(lines: list[str], marker: str) -> bool:
    """Whether the lines since the generation's ``marker`` say "address in use"."""
    # Only this generation's lines: an earlier generation's "address in use" still in the ring
    # must not turn every later early death into a free relaunch (no backoff, no count).
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(marker):
            lines = lines[i + 1 :]
            break
    return any(ADDRESS_IN_USE.search(line) for line in lines)


def answered_by_engine(engine: ProcessHandle, port: int | None) -> bool:
    """Whether the health port's listening socket belongs to the engine's process tree."""
    tree = engine.descendants()
    if port is None or not tree:
        return True  # nothing to compare with (e.g. a pyxis step whose pid is not known yet)
    for proc in tree:
        try:
            sockets = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets):
            return True
    return False
