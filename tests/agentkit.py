"""Real ``tilert-agent`` processes for tests: job directories, agents in their own groups, teardown.

A job directory is made the way users make one (``tilert-submit RECIPE --mock --dry-run``) with a
cluster file saying ``network_interface: lo`` and ``launcher: process``, so everything binds and
advertises 127.0.0.1. Each agent runs in its own process group; ``Agents.close`` kills every
process of every agent's tree (engines are in groups of their own), so nothing outlives a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "recipes" / "local-demo.yaml"
BIN = Path(sys.executable).parent
SUBMIT = str(BIN / "tilert-submit")
AGENT = str(BIN / "tilert-agent")
CLUSTER_FILE = "network_interface: lo\nlauncher: process\n"
# The demo's generous settings, made small so failures show within a second or two.
FAST = (
    "agent.restart.backoff_initial_s=0.05",
    "agent.restart.backoff_max_s=0.2",
    "agent.probe.interval_s=0.1",
    "agent.probe.timeout_s=0.5",
    "agent.stop_grace_s.decode=2",
    "agent.stop_grace_s.prefill=2",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without inherited TILERT_* switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def make_job(root: Path, *sets: str, recipe: Path = DEMO_RECIPE, fast: bool = True) -> Path:
    """``tilert-submit RECIPE --mock --dry-run --job-dir root/job --set ...``; the job directory."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = root / "srtslurm.yaml"
    cluster.write_text(CLUSTER_FILE)
    job = root / "job"
    argv = [SUBMIT, str(recipe), "--mock", "--dry-run", "--cluster", str(cluster)]
    argv += ["--job-dir", str(job)]
    for item in (*(FAST if fast else ()), *sets):
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"tilert-submit failed ({done.returncode}):\n{done.stderr}")
    return job


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; AssertionError naming ``what`` after."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            last = check()
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what} (last: {last!r})"
            )
        time.sleep(interval)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_alive(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of ``procs`` still running (same pid *and* start time) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


class AgentProc:
    """One ``tilert-agent`` subprocess in its own process group."""

    def __init__(self, job: Path, role: str, index: int, env: dict[str, str]) -> None:
        self.job = job
        self.role = role
        self.index = index
        self.name = f"{role}-{index}"
        self.popen = subprocess.Popen(
            [AGENT, "--role", role, "--index", str(index), "--job-dir", str(job)],
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

    def record(self) -> dict[str, Any] | None:
        """The agent's rendezvous record now, or None."""
        try:
            return json.loads(self.record_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def wait_record(self, timeout: float = 15.0) -> dict[str, Any]:
        """The record, once it exists."""
        return wait_for(f"{self.name}'s record", self._record_or_exit, timeout)

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
        return response.json()

    def wait_status(
        self, what: str, check: Callable[[dict[str, Any]], bool], timeout: float = 15.0
    ) -> dict[str, Any]:
        """The first ``/status`` for which ``check`` holds (AssertionError naming ``what``)."""

        def probe() -> dict[str, Any] | None:
            status = self.status()
            self.remember_tree()
            return status if check(status) else None

        return wait_for(f"{self.name} {what}", probe, timeout)

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
        """``tilert-agent --role ROLE --index N --job-dir JOB`` with a clean environment + ``env``."""
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
