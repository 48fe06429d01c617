"""Real ``tilert-agent`` processes for tests, each in its own process group, always reaped.

An agent runs on a job directory from ``make_job`` (tests/kit/jobs.py). ``Agents.close`` kills
every process of every agent's tree, the engines too (they lead groups of their own), so nothing
outlives a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.kit.commands import AGENT, REPO, clean_env
from tests.kit.waiting import wait_for


class AgentProc:
    """One ``tilert-agent`` subprocess in its own process group."""

    def __init__(self, job: Path, role: str, index: int, env: dict[str, str]) -> None:
        self.job = job
        self.role = role
        self.index = index
        self.name = f"{role}-{index}"
        self.popen = subprocess.Popen(
            [*AGENT, "--role", role, "--index", str(index), "--job-dir", str(job)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            process_group=0,
        )
        self.seen: dict[int, psutil.Process] = {}

    @property
    def pid(self) -> int:
        """The agent's pid (also its process group)."""
        return self.popen.pid

    @property
    def record_path(self) -> Path:
        """``J/rendezvous/<name>.json``."""
        return self.job / "rendezvous" / f"{self.name}.json"

    @property
    def agent_log(self) -> Path:
        """``J/logs/<name>/agent.log``."""
        return self.job / "logs" / self.name / "agent.log"

    def ended(self) -> bool:
        """The agent process has exited."""
        return self.popen.poll() is not None

    def record(self) -> dict[str, Any] | None:
        """The agent's rendezvous record now, or None."""
        try:
            data: dict[str, Any] = json.loads(self.record_path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return data

    def wait_record(self, timeout: float = 15.0) -> dict[str, Any]:
        """The record, once it exists."""
        found = wait_for(f"{self.name}'s record", self._record_or_exit, timeout)
        assert found is not None  # wait_for returns only a value that passed
        return found

    def _record_or_exit(self) -> dict[str, Any] | None:
        self._check_running()
        return self.record()

    def _check_running(self) -> None:
        if self.popen.poll() is not None:
            err = self.popen.stderr.read().decode(errors="replace") if self.popen.stderr else ""
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{err[-3000:]}")

    def url(self, path: str) -> str:
        """A URL on the agent's endpoint (from its record)."""
        record = self.record() or self.wait_record()
        return f"http://127.0.0.1:{record['ports']['agent']}{path}"

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /status``."""
        response = httpx.get(self.url("/status"), timeout=timeout)
        response.raise_for_status()
        status: dict[str, Any] = response.json()
        return status

    def wait_status(
        self, what: str, check: Callable[[dict[str, Any]], bool], timeout: float = 15.0
    ) -> dict[str, Any]:
        """The first ``/status`` for which ``check`` holds (AssertionError naming ``what``)."""

        def probe() -> dict[str, Any]:
            status = self.status()
            self.remember_tree()
            return status

        return wait_for(f"{self.name} {what}", probe, timeout, until=check)

    def wait_state(self, state: str, timeout: float = 15.0) -> dict[str, Any]:
        """The first ``/status`` in ``state``."""
        return self.wait_status(f"state {state}", lambda s: s["state"] == state, timeout)

    def tree(self) -> list[psutil.Process]:
        """The agent and every descendant now (engines, lifeline watchers)."""
        try:
            me = psutil.Process(self.pid)
            return [me, *me.children(recursive=True)]
        except psutil.Error:
            return []

    def remember_tree(self) -> list[psutil.Process]:
        """``tree()``, also remembered for teardown (engines that outlive the agent)."""
        procs = self.tree()
        for proc in procs:
            self.seen.setdefault(proc.pid, proc)
        return procs

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the agent process itself (not its group)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        """The agent's exit code (subprocess.TimeoutExpired after ``timeout``)."""
        return self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the agent's group, then everything of its tree ever seen."""
        procs = [*self.remember_tree(), *self.seen.values()]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for proc in procs:
            # An engine leads its own group: kill the group, grandchildren included.
            with contextlib.suppress(psutil.Error, OSError):
                if proc.is_running() and os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        if self.popen.stderr is not None:
            self.popen.stderr.close()


class Agents:
    """Agents started by one test; ``close`` kills them all (use from a fixture's teardown)."""

    def __init__(self) -> None:
        self.started: list[AgentProc] = []

    def start(self, job: Path, role: str = "decode", index: int = 0, **env: str) -> AgentProc:
        """``tilert-agent --role ROLE --index N --job-dir JOB`` with a clean environment +
        ``env``."""
        agent = AgentProc(job, role, index, clean_env(**env))
        self.started.append(agent)
        return agent

    def close(self) -> None:
        """Kill every agent started here and its engines."""
        for agent in self.started:
            agent.kill()


@contextlib.contextmanager
def running_agents() -> Iterator[Agents]:
    """``with running_agents() as agents: agents.start(job)``; everything killed on exit."""
    agents = Agents()
    try:
        yield agents
    finally:
        agents.close()
