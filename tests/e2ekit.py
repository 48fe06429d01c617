"""Helpers for the end-to-end tests (tests/test_e2e_local.py, test_e2e_slurm.py, test_e2e_observability.py).

A job is started exactly as a user starts it (``tilert-submit`` in a subprocess, in its own
process group), observed only through what users see (``status.json``, the agents' ``/status``
and ``/metrics``, the router's OpenAI API, the logs), and checked for leftovers by scanning the
process table. Every wait is bounded and, when it times out, says what the job looked like and
prints the tails of its agents' logs. The scenarios the local and the Slurm tests share are
functions here taking the job directory.
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

from tests.agentkit import DEMO_RECIPE, REPO, still_alive
from tests.infra.ports import free_port

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
AGENTS = ("prefill-0", "decode-0", "decode-1")
# What the stand-ins generate (docs/standins.md): the prefill's "H", then the decode's text.
ANSWER = "Hello from the TileRT decode stand-in."
MODEL = "demo-model"


def e2e_sets(router_python: Path | None, *extra: str) -> tuple[list[str], int]:
    """``--set`` flags for a test job: a free router port (8000 is shared), port bases of its
    own, the real router when ``router_python`` is given, then ``extra``; and the router port."""
    port = free_port()
    # Port bases of our own, away from the defaults every other job on this shared machine
    # uses: a probed-free port is only free until someone binds it (DESIGN.md, ports).
    b = random.randrange(20000, 30000, 100)
    bases = (
        f"{{prefill: {{http: {b}, agent: {b + 10}}}, "
        f"decode: {{http: {b + 20}, agent: {b + 40}, ctrl: {b + 60}}}}}"
    )
    sets = [
        *([f"agent.router_python={router_python}"] if router_python else []),
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


def current_status(job: Path) -> dict:
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
    accept: Callable[[dict], bool],
    what: str,
    timeout: float,
    *,
    seen: list[str] | None = None,
    poll_s: float = 0.02,
    each: Callable[[], None] | None = None,
) -> dict:
    """Poll status.json until ``accept(status)``; fail with the job's state and log tails.
    ``each`` runs after every poll that did not accept (it may fail the wait early)."""
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
        if each is not None:
            each()
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
    return still_alive(list(found.values()), 0)


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


def running_processes(job: Path, at_least: int) -> tuple[set[int], list[psutil.Process]]:
    """The job's ports and live processes, at least ``at_least`` of them."""
    ports = job_ports(job)
    procs = job_processes(job, ports)
    assert len(procs) >= at_least, describe(procs)
    return ports, procs


def assert_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Every one of ``procs`` ends within ``timeout``."""
    left = still_alive(procs, timeout)
    assert not left, "left behind:\n" + describe(left)


def assert_nothing_left(job: Path, timeout: float) -> None:
    """Every process of the job (by a fresh scan) ends within ``timeout``."""
    assert_gone(job_processes(job, job_ports(job)), timeout)


def kill_all(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each (teardown of a failed test)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


# ---- running tilert-submit -------------------------------------------------------------------


def submit_cmd(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``tilert-submit ARGS`` to its end (status, stop, logs, a Slurm submission)."""
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
    kills whatever is left (the group, every process of the job, every one it saw) on exit."""

    def __init__(
        self,
        job: Path,
        args: Sequence[str],
        *,
        recipe: Path = DEMO_RECIPE,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.job = job
        self.out = job.parent / f"{job.name}.submit.out"
        self._out = open(self.out, "wb")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(
            [*SUBMIT, str(recipe), "--local", "--mock", "--job-dir", str(job), *args],
            cwd=REPO,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {}

    def output(self) -> str:
        """What tilert-submit printed so far."""
        return self.out.read_text(errors="replace")

    def status(self) -> dict:
        """status.json now (fails when it cannot be read)."""
        return current_status(self.job)

    def agent(self, name: str) -> dict:
        """status.json's entry of agent ``name`` now."""
        return agent_entry(self.status(), name)

    def token(self) -> str:
        """The job's bearer token."""
        return (self.job / "token").read_text().strip()

    def remember_tree(self) -> None:
        """Note every process below tilert-submit, to prove later that none outlives it."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                self.seen.setdefault(proc.pid, proc)

    def _watch(self) -> None:
        self.remember_tree()
        if self.proc.poll() is not None:
            raise AssertionError(
                f"tilert-submit exited {self.proc.returncode}:\n{self.output()}\n"
                f"{log_tails(self.job)}"
            )

    def wait_state(self, *states: str, timeout: float) -> dict:
        """status.json once its state is one of ``states``, noting the process tree on every
        poll; fails as soon as tilert-submit has exited."""
        return wait_status(
            self.job,
            lambda s: s["state"] in states,
            f"in {states}",
            timeout,
            poll_s=0.1,
            each=self._watch,
        )

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

    def stop(self, timeout: float) -> tuple[int | None, list[psutil.Process]]:
        """SIGTERM tilert-submit; (its exit code or None after ``timeout``, the processes it was
        ever seen with that are still alive the moment it ended)."""
        self.remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, still_alive(list(self.seen.values()), 0)

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = [*job_processes(self.job, job_ports(self.job)), *self.seen.values()]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_all(leftovers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._out.close()


# ---- scenarios the local and the Slurm tests share -------------------------------------------


def check_ready_contract(job: Path) -> dict:
    """Ready per DESIGN.md: status.json's fields, every agent healthy, targets.json naming each
    agent's metrics address with only the ``agent`` label, the real router; the status."""
    status = current_status(job)
    assert status["state"] == "ready" and status["error"] is None, status
    assert status["router_url"].startswith("http://127.0.0.1:")
    assert status["model"] == MODEL
    names = [a["name"] for a in status["agents"]]
    assert names == list(AGENTS), names
    for entry in status["agents"]:
        assert set(entry) >= AGENT_FIELDS, entry
        assert entry["state"] == "healthy", entry
        assert entry["node"] and entry["status_url"] and entry["metrics_url"]
        assert Path(entry["log"]).is_file(), entry
    targets = json.loads((job / "prometheus" / "targets.json").read_text())
    assert sorted(t["labels"]["agent"] for t in targets) == sorted(names), targets
    by_agent = {t["labels"]["agent"]: t for t in targets}
    for entry in status["agents"]:
        target = by_agent[entry["name"]]
        assert set(target["labels"]) == {"agent"}, target  # no role/node/slurm_job_id
        assert target["targets"] == [entry["metrics_url"].split("//")[1].split("/")[0]]
    # The real router, not the stand-in.
    router_log = (job / "logs" / "prefill-0" / "router.log").read_text()
    assert "tilert.pd_vllm.pd_router" in router_log.splitlines()[0]
    assert "agent.standins.router" not in router_log
    assert "using the router stand-in" not in (job / "logs/prefill-0/agent.log").read_text()
    return status


def check_chat(job: Path) -> None:
    """A streamed chat through router_url returns the stand-ins' text; two at once too."""
    router_url = current_status(job)["router_url"]
    text = chat(router_url, MODEL)
    assert text == ANSWER, text
    texts = chat_concurrently(router_url, MODEL, 2)
    assert texts == [ANSWER] * 2, texts


def check_gate_latency(job: Path, where: str) -> None:
    """The head logs the gate latency and exports it; printed, bounded only by the budget."""
    log = (job / "logs" / "prefill-0" / "agent.log").read_text()
    line = next(x for x in log.splitlines() if "router started" in x)
    prefill = agent_entry(current_status(job), "prefill-0")
    gate = metric_value(prefill["metrics_url"], "tilert_agent_gate_latency_seconds")
    print(f"\n{where} gate latency: metric {gate} s; log: {line.split('head: ', 1)[-1]}")
    assert gate is not None and 0 <= gate < 60


def check_engine_sigkill_recovers(job: Path) -> None:
    """SIGKILL decode-0's engine: same ports, degraded then ready, the router not restarted."""
    status = current_status(job)
    d0 = agent_entry(status, "decode-0")
    before = agent_status(d0["status_url"])
    record_before = record(job, "decode-0")
    head = agent_status(agent_entry(status, "prefill-0")["status_url"])
    router_pid, router_restarts = head["router"]["pid"], head["router"]["restarts"]
    assert before["state"] == "healthy" and before["pid"]
    assert psutil.Process(before["pid"]).cmdline()[2] == "agent.standins.decode"

    seen: list[str] = []
    psutil.Process(before["pid"]).send_signal(signal.SIGKILL)
    wait_state(job, "degraded", 15, seen=seen)
    after_status = wait_state(job, "ready", 30, seen=seen)
    print(f"\nstates after the SIGKILL: {seen}")

    after = agent_status(d0["status_url"])
    assert after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1
    assert after["ports"] == before["ports"]
    assert record(job, "decode-0")["ports"] == record_before["ports"]
    assert agent_entry(after_status, "decode-0")["restarts"] == after["restarts"]
    head = agent_status(agent_entry(after_status, "prefill-0")["status_url"])
    assert head["router"]["pid"] == router_pid
    assert head["router"]["restarts"] == router_restarts == 0
    texts = chat_concurrently(after_status["router_url"], MODEL, 2)
    assert texts == [ANSWER] * 2, texts


def check_stopped(job: Path, status: dict, cmd: Callable[..., subprocess.CompletedProcess]) -> dict:
    """A stopped job: ``stopped`` without router_url; ``stop`` again is fine (``cmd`` runs
    tilert-submit); a "ready" left behind reads as STALE. The ``status --json`` view."""
    assert status["state"] == "stopped", status
    assert status["router_url"] is None
    assert cmd("stop", str(job)).returncode == 0
    (job / "status.json").write_text(json.dumps(dict(status, state="ready")))
    done = cmd("status", str(job), "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["stale"] is True, view
    assert "STALE" in cmd("status", str(job)).stdout
    return view


# Faults: the recipe overrides and what the job must show.
DECODE_CRASH_LOOP = (
    "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
    "roles.decode.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
    "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 2, window_s: 60}",
)
PREFILL_CRASH_LOOP = (
    "roles.prefill.env.TILERT_MOCK_CRASH_AFTER_S=0.3",
    "agent.restart={backoff_initial_s: 0.1, backoff_max_s: 0.2, max_restarts: 1, window_s: 60}",
)
DECODES_NEVER_HEALTHY = (
    # Bound and hanging (not a startup delay, whose unbound ports another job could take).
    "roles.decode.env.TILERT_MOCK_HANG_HEALTH=1",
    "agent.startup_budget_s={prefill: 3, decode: 3, router: 60}",
)


def check_decode_dropped(job: Path, timeout: float) -> dict:
    """decode-1 crash-looping: dropped (failed, its log named), the job degraded and the router
    serving without it through decode-0; the status."""
    status = wait_status(
        job,
        lambda s: (
            s["state"] == "degraded"
            and agent_entry(s, "decode-1")["state"] == "failed"
            and "dropped" in agent_entry(s, "decode-1")["reason"]
            and s["router_url"] is not None
            and router_serves_without(job, s, "decode-1")
        ),
        "degraded with decode-1 dropped and the router healthy without it",
        timeout,
    )
    d1 = agent_entry(status, "decode-1")
    assert d1["log"].endswith("logs/decode-1/engine.log") and Path(d1["log"]).is_file(), d1
    assert "gave up" in d1["reason"], d1
    assert "restart" in d1["reason"] or "exited" in d1["reason"], d1
    assert agent_entry(status, "decode-0")["state"] == "healthy"
    assert chat(status["router_url"], MODEL) == ANSWER
    return status


def check_prefill_failed(job: Path, status: dict) -> None:
    """The prefill crash-looping: failed naming prefill-0 and its log; its agent exited 1 and
    nothing of the job is left."""
    assert status["state"] == "failed", status
    assert "prefill-0" in status["error"], status["error"]
    assert "logs/prefill-0/engine.log" in status["error"], status["error"]
    assert agent_entry(status, "prefill-0")["state"] == "failed"
    assert "exiting with code 1" in (job / "logs/prefill-0/agent.log").read_text()
    assert_nothing_left(job, 10)


def check_decodes_never_healthy(job: Path, status: dict) -> None:
    """Decodes that never answer within the startup budget: failed naming each and its log;
    nothing of the job is left."""
    assert status["state"] == "failed", status
    for name in ("decode-0", "decode-1"):
        assert name in status["error"], status["error"]
        assert f"logs/{name}/engine.log" in status["error"], status["error"]
    assert "startup" in status["error"], status["error"]
    assert_nothing_left(job, 10)
