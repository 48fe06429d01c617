"""Reading a job directory as users do: ``status.json``, the rendezvous records, the logs.

``wait_status`` is how a test waits for a job: it polls ``status.json`` (a half-written file is
"not yet") and, when it gives up, shows the states it saw, the last status and the tails of the
agents' logs.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.kit.waiting import wait_for


def read_status(job: Path) -> dict[str, Any] | None:
    """``J/status.json`` as a dict, or None while it is missing or half-written."""
    try:
        status: dict[str, Any] = json.loads((job / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return status


def current_status(job: Path) -> dict[str, Any]:
    """``J/status.json`` now (fails when it cannot be read)."""
    status = read_status(job)
    assert status is not None, f"{job}: no readable status.json\n{log_tails(job)}"
    return status


def log_tails(job: Path, lines: int = 25) -> str:
    """The last lines of every agent.log (and the router log, sbatch.out) of the job."""
    out = []
    logs = job / "logs"
    files = sorted(logs.glob("*/agent.log")) + sorted(logs.glob("*/router.log"))
    files += [logs / "sbatch.out"]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.relative_to(job)} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out) or f"(no logs under {logs})"


def wait_status(
    job: Path,
    accept: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float,
    *,
    seen: list[str] | None = None,
    poll_s: float = 0.02,
    each: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Poll status.json until ``accept(status)``; fail with the job's state and log tails.
    Every state seen is appended to ``seen`` (once per change). ``each`` runs after every poll
    that did not accept (it may fail the wait early)."""
    states = seen if seen is not None else []
    last: list[dict[str, Any]] = []

    def probe() -> dict[str, Any] | None:
        status = read_status(job)
        if status is not None:
            last[:] = [status]
            if not states or states[-1] != status["state"]:
                states.append(status["state"])
            if accept(status):
                return status
        if each is not None:
            each()
        return None

    def detail() -> str:
        summary = json.dumps(last[0], indent=1)[:3000] if last else "(no status.json)"
        return f"states seen {states}; last status.json:\n{summary}\n{log_tails(job)}"

    found = wait_for(f"{job} {what}", probe, timeout, interval=poll_s, detail=detail)
    assert found is not None  # wait_for returns only a value that passed
    return found


def wait_state(
    job: Path, states: str | Sequence[str], timeout: float, seen: list[str] | None = None
) -> dict[str, Any]:
    """Wait until status.json's state is one of ``states``."""
    wanted = (states,) if isinstance(states, str) else tuple(states)
    return wait_status(job, lambda s: s["state"] in wanted, f"in {wanted}", timeout, seen=seen)


def agent_entry(status: dict[str, Any], name: str) -> dict[str, Any]:
    """The status.json entry of agent ``name``."""
    for entry in status["agents"]:
        if entry["name"] == name:
            return dict(entry)
    raise AssertionError(f"no agent {name} in status.json: {[a['name'] for a in status['agents']]}")


def record(job: Path, name: str) -> dict[str, Any]:
    """An agent's rendezvous record."""
    data: dict[str, Any] = json.loads((job / "rendezvous" / f"{name}.json").read_text())
    return data


def job_ports(job: Path) -> set[int]:
    """Every port the job's records publish."""
    ports: set[int] = set()
    for path in (job / "rendezvous").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            ports |= set(json.loads(path.read_text())["ports"].values())
    return ports
