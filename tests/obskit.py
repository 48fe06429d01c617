"""Helpers for the observability end-to-end tests: a running local mock job, and metrics pages.

``RunningJob`` is ``tilert-submit RECIPE --local --mock`` as a subprocess in its own process group,
on ports chosen free for this run (so parallel runs never meet on the demo's fixed 8000). Pages are
read with prometheus_client's parser, which shares no code with ``agent/reexport.py``, so the
comparison is an independent check of the re-export.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.infra.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
DEMO_RECIPE = REPO / "recipes" / "local-demo.yaml"
READY_TIMEOUT_S = 40.0
STOP_TIMEOUT_S = 30.0

Labels = frozenset[tuple[str, str]]


def submit_argv(*args: str) -> list[str]:
    """``tilert-submit ARGS`` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "submit.cli", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without inherited TILERT_* switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def port_overrides() -> list[str]:
    """``--set`` flags moving every port base and the router port to ports free right now."""
    router, p_http, p_agent, d_http, d_agent, d_ctrl = free_ports(6)
    sets = {
        "agent.router_port": router,
        "agent.ports.prefill.http": p_http,
        "agent.ports.prefill.agent": p_agent,
        "agent.ports.decode.http": d_http,
        "agent.ports.decode.agent": d_agent,
        "agent.ports.decode.ctrl": d_ctrl,
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


class RunningJob:
    """A ``--local --mock`` job in the foreground of a subprocess, stopped by SIGTERM."""

    def __init__(self, job_dir: Path, sets: Sequence[str], output: Path) -> None:
        self.dir = job_dir
        self.output = output
        argv = submit_argv(
            str(DEMO_RECIPE), "--local", "--mock", "--job-dir", str(job_dir), *port_overrides()
        )
        for item in sets:
            argv += ["--set", item]
        self.argv = argv
        self._out = open(output, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            cwd=REPO,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._seen: dict[int, psutil.Process] = {}

    def log(self) -> str:
        """What the submitter printed so far."""
        return self.output.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        """J/status.json now (``{}`` while it cannot be read)."""
        try:
            data: dict[str, Any] = json.loads((self.dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}
        return data

    def wait_state(self, *states: str, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """status.json once its state is one of ``states``; fails if the submitter exits first."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.remember_tree()
            status = self.status()
            if status.get("state") in states:
                return status
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"tilert-submit exited {self.popen.returncode} before {states}:\n{self.log()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"job not {states} within {timeout}s: {status}\n{self.log()}")

    def remember_tree(self) -> None:
        """Note every process below the submitter, to prove later that none outlives it."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.popen.pid)
            for proc in [root, *root.children(recursive=True)]:
                self._seen.setdefault(proc.pid, proc)

    def agent(self, name: str) -> dict[str, Any]:
        """The status.json entry of agent ``name``."""
        for entry in self.status().get("agents", []):
            if entry["name"] == name:
                return dict(entry)
        raise KeyError(name)

    def token(self) -> str:
        """The job's bearer token."""
        return (self.dir / "token").read_text().strip()

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGTERM the submitter; (its exit code, processes still alive after it ended)."""
        self.remember_tree()
        code: int | None = None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        alive = []
        for proc in self._seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
        self._kill_leftovers()
        self._out.close()
        return code, alive

    def _kill_leftovers(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for proc in self._seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        if self.popen.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)


# ---- pages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One sample line: name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def samples(page: str) -> list[Sample]:
    """Every sample of a classic text page (prometheus_client's parser, independent of ours)."""
    out = []
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out.append(Sample(s.name, dict(s.labels), float(s.value)))
    return out


def sample_map(page: str) -> dict[tuple[str, Labels], float]:
    """``{(name, labels): value}`` of a page; a duplicate series fails."""
    out: dict[tuple[str, Labels], float] = {}
    for s in samples(page):
        key = (s.name, frozenset(s.labels.items()))
        assert key not in out, f"series twice on the page: {s.name}{s.labels}"
        out[key] = s.value
    return out


def families(page: str) -> list[str]:
    """Family names in TYPE order, after checking that no family or sample name repeats."""
    declared: list[str] = []
    owner: dict[str, str] = {}
    current = ""
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            current = line.split()[2]
            assert current not in declared, f"family {current} declared twice on the page"
            declared.append(current)
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            assert owner.setdefault(name, current) == current, (
                f"{name} appears under both {owner[name]} and {current}"
            )
    return declared


def find(page_samples: Iterable[Sample], name: str, **labels: str) -> Iterator[Sample]:
    """Samples called ``name`` whose labels include ``labels``."""
    for s in page_samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            yield s


def one(page_samples: Iterable[Sample], name: str, **labels: str) -> Sample:
    """The single sample ``name{labels...}``; fails naming what was found."""
    found = list(find(page_samples, name, **labels))
    assert len(found) == 1, f"expected one {name}{labels}, found {found}"
    return found[0]


def get(url: str, **kwargs: Any) -> httpx.Response:
    """GET with a short timeout (the agents answer within milliseconds)."""
    return httpx.get(url, timeout=10, **kwargs)
