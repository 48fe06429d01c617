"""Helpers for the end-to-end bring-up tests (tests/test_e2e_local.py, tests/test_e2e_slurm.py).

A job is started exactly as a user starts it (``tilert-submit`` in a subprocess, in its own
process group), observed only through what users see (``status.json``, the agents' ``/status``
and ``/metrics``, the router's OpenAI API, the logs), and checked for leftovers by scanning the
process table. Every wait is bounded and, when it times out, says what the job looked like and
prints the tails of its agents' logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from tests.infra.ports import free_port

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "recipes" / "local-demo.yaml"
SUBMIT = [sys.executable, "-m", "submit.cli"]
# What a --mock job runs besides the agents (their command lines do not name the job directory).
STANDIN_MARKERS = ("agent.standins.", "tilert.pd_vllm.pd_router")
AGENT_FIELDS = {
    "name",
    "role",
    "index",
    "node",
    "state",
    "restarts",
    "reason",
    "log",
    "metrics_url",
    "status_url",
}
TERMINAL = ("stopped", "failed")
# What the stand-ins generate (docs/standins.md): the prefill's "H", then the decode's text.
ANSWER = "Hello from the TileRT decode stand-in."


def e2e_sets(router_python: Path, *extra: str) -> tuple[list[str], int]:
    """``--set`` flags for a test job: the real router and a free router port (8000 is shared)."""
    port = free_port()
    # Port bases of our own, away from the defaults every other job on this shared machine
    # uses: a probed-free port is only free until someone binds it (DESIGN.md, ports).
    b = random.randrange(20000, 30000, 100)
    bases = (
        f"{{prefill: {{http: {b}, agent: {b + 10}}}, "
        f"decode: {{http: {b + 20}, agent: {b + 40}, ctrl: {b + 60}}}}}"
    )
    sets = [
        f"agent.router_python={router_python}",
        f"agent.router_port={port}",
        f"agent.ports={bases}",
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)], port


# ---- reading the job ---------------------------------------------------------------------------


def read_status(job: Path) -> dict | None:
    """``J/status.json`` as a dict, or None while it is missing or half-written."""
    try:
        return json.loads((job / "status.json").read_text())
    except (OSError, ValueError):
        return None


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
    accept: Callable[[dict], bool],
    what: str,
    timeout: float,
    *,
    seen: list[str] | None = None,
    poll_s: float = 0.02,
) -> dict:
    """Poll status.json until ``accept(status)``; fail with the job's state and log tails."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        status = read_status(job)
        if status is not None:
            last = status
            if seen is not None and (not seen or seen[-1] != status["state"]):
                seen.append(status["state"])
            if accept(status):
                return status
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    summary = json.dumps(last, indent=1)[:3000] if last else "(no status.json)"
    raise AssertionError(
        f"{job}: not {what} within {timeout:g}s; states seen {seen}; last status.json:\n"
        f"{summary}\n{log_tails(job)}"
    )


def wait_state(
    job: Path, states: str | Sequence[str], timeout: float, seen: list[str] | None = None
) -> dict:
    """Wait until status.json's state is one of ``states``."""
    wanted = (states,) if isinstance(states, str) else tuple(states)
    return wait_status(job, lambda s: s["state"] in wanted, f"in {wanted}", timeout, seen=seen)


def agent_entry(status: dict, name: str) -> dict:
    """The status.json entry of agent ``name``."""
    for entry in status["agents"]:
        if entry["name"] == name:
            return entry
    raise AssertionError(f"no agent {name} in status.json: {[a['name'] for a in status['agents']]}")


def router_serves_without(job: Path, status: dict, name: str) -> bool:
    """The router is healthy, and its running generation was launched without agent ``name``
    (its pid is the one of the last ``=== router generation`` line in router.log)."""
    head = agent_status(agent_entry(status, "prefill-0")["status_url"]).get("router")
    if head is None or head["state"] != "healthy":
        return False
    log = job / "logs" / "prefill-0" / "router.log"
    starts = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("=== router")]
    if not starts or f"pid {head['pid']}:" not in starts[-1]:
        return False
    http = record(job, name)["ports"]["http"]
    return f":{http} " not in starts[-1] and not starts[-1].endswith(f":{http}")


def agent_status(status_url: str) -> dict:
    """An agent's live ``/status``."""
    response = httpx.get(status_url, timeout=5)
    response.raise_for_status()
    return response.json()


def record(job: Path, name: str) -> dict:
    """An agent's rendezvous record."""
    return json.loads((job / "rendezvous" / f"{name}.json").read_text())


def metric_value(metrics_url: str, family: str) -> float | None:
    """The first sample of ``family`` on a /metrics page, or None when absent."""
    text = httpx.get(metrics_url, timeout=5).text
    for line in text.splitlines():
        if line.startswith(family) and line[len(family)] in " {":
            return float(line.rsplit(" ", 1)[1])
    return None


# ---- the router ----------------------------------------------------------------------------


def chat(router_url: str, model: str, prompt: str = "Hello", timeout: float = 30.0) -> str:
    """One streaming chat completion through the router; the generated text (raises on error)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "stream": True,
    }
    text = ""
    with httpx.stream(
        "POST", f"{router_url}/v1/chat/completions", json=body, timeout=timeout
    ) as response:
        if response.status_code != 200:
            raise AssertionError(f"router answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                continue
            chunk = json.loads(line[5:])
            assert "error" not in chunk, chunk
            assert chunk.get("model") == model, chunk
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def chat_concurrently(router_url: str, model: str, count: int) -> list[str]:
    """``count`` streaming chats at once; their texts."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(chat, router_url, model, f"Hello {i}") for i in range(count)]
        return [f.result() for f in futures]


# ---- processes -----------------------------------------------------------------------------


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def job_processes(job: Path, ports: Iterable[int] = ()) -> list[psutil.Process]:
    """Every live process of the job: those naming the job directory, their descendants, and
    stand-ins or routers listening on one of ``ports`` (the job's published ports)."""
    needle = str(job)
    found: dict[int, psutil.Process] = {}
    port_set = set(ports)
    for proc in psutil.process_iter():
        cmd = _cmdline(proc)
        if needle in cmd:
            found[proc.pid] = proc
        elif port_set and any(m in cmd for m in STANDIN_MARKERS):
            with contextlib.suppress(psutil.Error):
                listening = {c.laddr.port for c in proc.net_connections("inet") if c.laddr}
                if listening & port_set:
                    found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found[child.pid] = child
    return [p for p in found.values() if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def job_ports(job: Path) -> set[int]:
    """Every port the job's records publish."""
    ports: set[int] = set()
    for path in (job / "rendezvous").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            ports |= set(json.loads(path.read_text())["ports"].values())
    return ports


def describe(procs: Iterable[psutil.Process]) -> str:
    """pid and command line of each process, one a line."""
    return "\n".join(f"  {p.pid}: {_cmdline(p)[:200]}" for p in procs) or "  (none)"


def wait_gone(procs: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` runs; those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if _alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_all(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each (teardown of a failed test)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


# ---- running tilert-submit -------------------------------------------------------------------


def submit_cmd(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``tilert-submit ARGS`` to its end (status, stop, a Slurm submission)."""
    return subprocess.run(
        [*SUBMIT, *args],
        cwd=REPO,
        env=dict(env or os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class LocalJob:
    """``tilert-submit RECIPE --local --mock`` in its own process group; a context manager that
    kills whatever is left (the group and every process of the job) on exit."""

    def __init__(self, job: Path, recipe: Path, args: Sequence[str]) -> None:
        self.job = job
        self.out = job.parent / f"{job.name}.submit.out"
        self._out = open(self.out, "wb")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(
            [*SUBMIT, str(recipe), "--local", "--mock", "--job-dir", str(job), *args],
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        """What tilert-submit printed so far."""
        return self.out.read_text(errors="replace")

    def wait_output(self, text: str, timeout: float) -> str:
        """Wait until tilert-submit has printed ``text``; its output."""
        deadline = time.monotonic() + timeout
        while text not in (out := self.output()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"tilert-submit did not print {text!r}:\n{out}")
            time.sleep(0.05)
        return out

    def wait_exit(self, timeout: float) -> int:
        """Wait for tilert-submit to exit; its code (fails with its output when it does not)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"tilert-submit still running after {timeout:g}s:\n{self.output()}\n"
                f"{log_tails(self.job)}"
            ) from None

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = job_processes(self.job, job_ports(self.job))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_all(leftovers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._out.close()
