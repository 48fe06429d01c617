"""The chaos benchmark's faults, done to a running local job as an operator (or bad luck) would:
an engine's SIGKILL (its pid from its agent's ``/status``), the router's (from the head's
``/status``), a decode agent's SIGKILL and its restart by hand under the same name once the head
dropped it (as systemd or an operator would, docs/agent.md "Rejoin"), ``tilert-submit scale``.

Each returns when the fault struck, and a check of status.json that holds once the job is
``ready`` again after it (the restart counted, the decode taken back, the pool at its size).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.bench.chaosplan import Fault
from tests.bench.procs import env, scale
from tests.kit.commands import AGENT, REPO
from tests.kit.jobdir import read_status
from tests.kit.processes import agent_process

Check = Callable[[dict[str, Any]], bool]
DROP_TIMEOUT_S = 60.0


def rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.json's agent rows by name, the router's under ``router``."""
    out = {a["name"]: a for a in status.get("agents") or []}
    if status.get("router"):
        out["router"] = status["router"]
    return out


def _live_status(status_url: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(status_url, timeout=10).json()
    return answer


def _wait_status(job: Path, check: Check, timeout_s: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(job)
        if status is not None and check(status):
            return status
        time.sleep(0.05)
    raise RuntimeError(f"{job}: not {what} within {timeout_s:g} s")


@dataclass
class Faults:
    """The faults of one job, and the agents they started (stopped by ``close``)."""

    job: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def strike(self, fault: Fault) -> tuple[float, Check]:
        """Do ``fault``: (when it struck, the check of ready-again)."""
        before = rows(self._status())
        if fault.kind in ("decode-engine", "prefill-engine"):
            name = fault.target if fault.kind == "decode-engine" else "prefill-0"
            pid = int(_live_status(before[name]["status_url"])["pid"])
            at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            return at, _ready_with(name, "restarts", before[name]["restarts"])
        if fault.kind == "router":
            head = _live_status(before["prefill-0"]["status_url"])
            at = time.monotonic()
            os.kill(int(head["router"]["pid"]), signal.SIGKILL)
            return at, _ready_with("router", "restarts", before["router"]["restarts"])
        if fault.kind == "decode-agent":
            return self._agent(fault.target, before)
        return self._scale(int(fault.target))

    def _status(self) -> dict[str, Any]:
        status = read_status(self.job)
        if status is None:
            raise RuntimeError(f"{self.job}: status.json cannot be read")
        return status

    def _agent(self, name: str, before: dict[str, dict[str, Any]]) -> tuple[float, Check]:
        """SIGKILL of the agent (its engine dies with it); once the head dropped it, a new
        agent of the same name, started by hand, to rejoin."""
        proc = agent_process(self.job, name)
        at = time.monotonic()
        proc.kill()
        _wait_status(
            self.job,
            lambda s: "dropped" in (rows(s).get(name, {}).get("reason") or ""),
            DROP_TIMEOUT_S,
            f"{name} dropped",
        )
        index = name.rsplit("-", 1)[1]
        log = open(self.job.parent / f"{name}-restarted.out", "ab")  # noqa: SIM115 (the child's)
        with log:
            self.started.append(
                subprocess.Popen(
                    [*AGENT, "--role", "decode", "--index", index, "--job-dir", str(self.job)],
                    cwd=REPO,
                    env=env(PYTHONUNBUFFERED="1"),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=0,
                )
            )
        return at, _ready_with(name, "rejoins", before[name].get("rejoins") or 0)

    def _scale(self, count: int) -> tuple[float, Check]:
        at = time.monotonic()
        scale(self.job, count)

        def sized(status: dict[str, Any]) -> bool:
            decodes = [n for n in rows(status) if n.startswith("decode-")]
            return status["state"] == "ready" and len(decodes) == count

        return at, sized

    def close(self) -> None:
        """Kill every agent this started, with its engines (their process group)."""
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _ready_with(name: str, key: str, before: int) -> Check:
    """status.json ``ready`` with ``name``'s ``key`` (restarts, rejoins) past ``before``."""

    def check(status: dict[str, Any]) -> bool:
        row = rows(status).get(name)
        return status["state"] == "ready" and row is not None and (row.get(key) or 0) > before

    return check


def wait_ready(job: Path, check: Check, timeout_s: float) -> float | None:
    """The monotonic time ``check`` first held (status.json polled every 50 ms), or None."""
    try:
        _wait_status(job, check, timeout_s, "ready again")
    except RuntimeError:
        return None
    return time.monotonic()
