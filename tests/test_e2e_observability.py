"""Observability end to end: one running ``--local --mock`` job, its pages, a real Prometheus.

The job runs the demo recipe with the prefill stand-in replaying a genuine vLLM 0.32 page
(``TILERT_MOCK_METRICS_FILE``, re-read on every scrape, so swapping the file's content mid-run
plays a hostile upstream) and a secret in the prefill's environment. The tests share that job
(``job``: ready, the genuine page re-exported, before each test; started again after a test that
stopped it or failed), so each passes alone and in any order; the stop test gets it through
``job_to_stop``, stops it and proves nothing is left behind.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from agent.job.atomicfile import write_atomic
from tests import kit
from tests.infra.prometheus import PrometheusServer, promtool_binary, promtool_check_metrics
from tests.kit import clean_env, get
from tests.kit.metrics import families, find, one, sample_map, samples

DATA = kit.REPO / "tests" / "data" / "metrics"
VLLM_PAGE = DATA / "vllm-0.32-cpu.txt"
# The TYPE lines of its vllm: families: the prefill's page re-exports the genuine page when its
# own TYPE lines are these.
VLLM_TYPES = {ln for ln in VLLM_PAGE.read_text().splitlines() if ln.startswith("# TYPE vllm:")}
# Unique to this run: another run of these tests on the machine has a submitter with its own.
SECRET = f"s3cr3t-value-{secrets.token_hex(4)}"
AGENTS = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
OURS = ("role", "node", "slurm_job_id")
ENGINE_FAMILIES = (
    "tilert_agent_engine_state",
    "tilert_agent_engine_up",
    "tilert_agent_engine_restarts_total",
    "tilert_agent_probe_latency_seconds_count",
    "tilert_agent_time_to_healthy_seconds",
    "tilert_agent_engine_cpu_seconds_total",
    "tilert_agent_engine_resident_memory_bytes",
    "tilert_agent_engine_threads",
    "tilert_agent_engine_open_files",
    "tilert_agent_engine_processes",
    "tilert_agent_log_lines_total",
    "tilert_agent_log_bytes_total",
)
HEAD_FAMILIES = (
    "tilert_agent_job_state",
    "tilert_agent_gate_latency_seconds",
    "tilert_agent_canary_latency_seconds",
)
# Hostile pages swapped in while the job runs (each is refused whole by the re-export).
HOSTILE = (
    "bad-truncated.txt",
    "bad-nul.bin",
    "bad-duplicate-series.txt",
    "bad-fold-clash.txt",
)
READY_S = 40.0
STOP_S = 30.0
# The re-export caches the upstream page for 1 s; a change shows within a few scrapes.
CHANGE_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def upstream_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the genuine vLLM page the prefill stand-in serves; tests swap its content."""
    path = tmp_path_factory.mktemp("upstream") / "vllm-metrics.txt"
    shutil.copyfile(VLLM_PAGE, path)
    return path


@pytest.fixture(scope="module")
def shared_job(
    tmp_path_factory: pytest.TempPathFactory, upstream_file: Path
) -> Iterator[kit.Shared[kit.LocalJob]]:
    """The job this module's tests share (see the docstring); each one ends with a SIGTERM
    (a graceful stop) before the sweep."""

    @contextlib.contextmanager
    def start() -> Iterator[kit.LocalJob]:
        sets, _ = kit.isolated_sets(
            None,
            f"roles.prefill.env.TILERT_MOCK_METRICS_FILE={upstream_file}",
            f"roles.prefill.env.HF_TOKEN={SECRET}",
        )
        root = tmp_path_factory.mktemp("obsjob")
        with kit.LocalJob(root / "J", sets, env=clean_env()) as running:
            yield running
            running.stop(STOP_S)

    def prepare(running: kit.LocalJob) -> None:
        running.wait_state("ready", timeout=READY_S)
        if upstream_file.read_bytes() != VLLM_PAGE.read_bytes():
            write_atomic(upstream_file, VLLM_PAGE.read_bytes())
        wait_page(
            running, "prefill-0", serves_genuine, "re-exporting the genuine vLLM page", READY_S
        )

    with kit.Shared(start, prepare=prepare, ended=kit.LocalJob.ended) as shared:
        yield shared


@pytest.fixture
def job(
    shared_job: kit.Shared[kit.LocalJob], request: pytest.FixtureRequest
) -> Iterator[kit.LocalJob]:
    """The shared job, ready, the prefill re-exporting the genuine vLLM page."""
    yield from shared_job.borrow(request)


@pytest.fixture
def job_to_stop(shared_job: kit.Shared[kit.LocalJob]) -> Iterator[kit.LocalJob]:
    """The shared job, as ``job`` gives it, for a test that stops it (the next starts another)."""
    yield from shared_job.consume()


def metrics_urls(job: kit.LocalJob) -> dict[str, str]:
    """``{agent name: metrics_url}`` from status.json."""
    return {a["name"]: a["metrics_url"] for a in job.status()["agents"]}


def page(job: kit.LocalJob, name: str) -> str:
    """Agent ``name``'s /metrics page (must answer 200 in the classic text format)."""
    resp = get(metrics_urls(job)[name])
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return resp.text


def upstream_up(text: str) -> float:
    """The value of ``tilert_agent_upstream_up`` on a prefill page."""
    return one(samples(text), "tilert_agent_upstream_up").value


def serves_genuine(text: str) -> bool:
    """A prefill page that re-exports the genuine vLLM page: upstream up, its vllm: families."""
    served = {ln for ln in text.splitlines() if ln.startswith("# TYPE vllm:")}
    return upstream_up(text) == 1.0 and served == VLLM_TYPES


def wait_page(
    job: kit.LocalJob,
    name: str,
    ok: Callable[[str], bool],
    what: str,
    timeout: float = CHANGE_TIMEOUT_S,
) -> str:
    """Agent ``name``'s page once ``ok(page)`` holds (``what`` says what that means)."""
    return kit.wait_for(
        f"{name}'s page {what}", lambda: page(job, name), timeout, until=ok, interval=0.2
    )


def check_promtool(text: str, what: str) -> None:
    """promtool finds no parse error (exit 0, or 3 for vLLM's expected lint findings)."""
    code, output = promtool_check_metrics(text)
    assert code in (0, 3), f"promtool check metrics on {what}: exit {code}\n{output}"
    assert "error while linting" not in output, output
    lint = [line for line in output.splitlines() if line.strip()]
    unexpected = [
        line
        for line in lint
        if "should not contain ':'" not in line
        and 'non-counter metrics should not have "_total" suffix' not in line
    ]
    assert not unexpected, f"unexpected promtool findings on {what}: {unexpected}"


@pytest.fixture
def promtool() -> None:
    """Skip (or fail under CI) without promtool."""
    from tests.conftest import require

    require(promtool_binary() is not None, "promtool not installed")


# ---- 1. promtool ------------------------------------------------------------------------------


@pytest.mark.usefixtures("promtool")
def test_promtool_finds_no_parse_error_on_any_page(job: kit.LocalJob) -> None:
    """Every metrics_url in status.json parses for promtool."""
    urls = metrics_urls(job)
    assert set(urls) == set(AGENTS)
    for name in urls:
        check_promtool(page(job, name), name)


# ---- 2. the genuine vLLM page -----------------------------------------------------------------


def test_genuine_vllm_page_is_reexported_whole(job: kit.LocalJob) -> None:
    """Every vllm: sample of the captured page, with our labels added, and nothing that clashes."""
    node = job.agent("prefill-0")["node"]
    ours = {"role": "prefill", "node": node, "slurm_job_id": "local"}
    text = page(job, "prefill-0")
    assert upstream_up(text) == 1.0
    served = sample_map(text)
    upstream = VLLM_PAGE.read_text()
    expected = [s for s in samples(upstream) if s.name.startswith("vllm:")]
    assert len(expected) > 300  # the captured page: 39 vllm: families
    missing = []
    for s in expected:
        key = (s.name, frozenset({**s.labels, **ours}.items()))
        if key not in served:
            missing.append(f"{s.name}{s.labels}")
        elif served[key] != s.value and not (math.isnan(s.value) and math.isnan(served[key])):
            missing.append(f"{s.name}{s.labels}: {served[key]} != {s.value}")
    assert not missing, f"{len(missing)} upstream samples missing or changed: {missing[:5]}"
    # Every vllm: family keeps its TYPE line.
    upstream_types = {ln for ln in upstream.splitlines() if ln.startswith("# TYPE vllm:")}
    served_types = {ln for ln in text.splitlines() if ln.startswith("# TYPE vllm:")}
    assert upstream_types == served_types
    # Nothing served that the upstream page did not have, apart from our own series.
    extra = [k for k in served if k[0].startswith("vllm:")]
    assert len(extra) == len(expected)
    # No job/instance label anywhere, our labels everywhere.
    for key in served:
        labels = dict(key[1])
        assert "job" not in labels, key
        assert "instance" not in labels, key
        assert {k: labels.get(k) for k in OURS} == ours, key
    # Upstream process_/python_/http_ families are dropped: no family or sample name twice.
    declared = families(text)
    assert not [f for f in declared if f.startswith(("process_", "python_", "http_"))]
    assert len(declared) == len(set(declared))


# ---- 3. hostile upstream pages ----------------------------------------------------------------


@pytest.mark.usefixtures("promtool")
def test_hostile_upstream_pages_keep_the_agents_own_page(
    job: kit.LocalJob, upstream_file: Path
) -> None:
    """Bad page or 500: /metrics still 200 with every tilert_agent_* series, upstream_up 0."""
    good = page(job, "prefill-0")
    own = {f for f in families(good) if f.startswith("tilert_agent_")}
    own_series = {k for k in sample_map(good) if k[0].startswith("tilert_agent_")}
    assert "tilert_agent_upstream_up" in own

    def check_down(what: str) -> None:
        text = wait_page(job, "prefill-0", lambda t: upstream_up(t) == 0.0, f"down on {what}")
        assert not [ln for ln in text.splitlines() if "vllm:" in ln], what
        assert {f for f in families(text) if f.startswith("tilert_agent_")} == own, what
        # Same series, values apart (the counters move on between scrapes).
        assert {k for k in sample_map(text) if k[0].startswith("tilert_agent_")} == own_series
        check_promtool(text, f"prefill-0 with {what} upstream")

    try:
        for bad in HOSTILE:
            write_atomic(upstream_file, (DATA / bad).read_bytes())
            check_down(bad)
            write_atomic(upstream_file, VLLM_PAGE.read_bytes())
            wait_page(job, "prefill-0", lambda t: upstream_up(t) == 1.0, f"up again after {bad}")
        upstream_file.unlink()  # the stand-in answers 500 while its file is missing
        check_down("a missing file (HTTP 500)")
    finally:
        write_atomic(upstream_file, VLLM_PAGE.read_bytes())
    text = wait_page(job, "prefill-0", lambda t: upstream_up(t) == 1.0, "up again at the end")
    assert "vllm:num_requests_running{" in text


CLASHING = """\
# HELP tilert_agent_canary_latency_seconds not ours
# TYPE tilert_agent_canary_latency_seconds gauge
tilert_agent_canary_latency_seconds 123
# HELP tilert_agent_gate_latency_seconds not ours
# TYPE tilert_agent_gate_latency_seconds gauge
tilert_agent_gate_latency_seconds 123
# TYPE tilert_agent_engine_up gauge
tilert_agent_engine_up 0
# TYPE tilert_agent_upstream_up gauge
tilert_agent_upstream_up 0
# HELP vllm:test_clashing_page_marker only on the page with the clashing families
# TYPE vllm:test_clashing_page_marker gauge
vllm:test_clashing_page_marker 1
"""


@pytest.mark.usefixtures("promtool")
def test_upstream_families_named_like_ours_are_dropped(
    job: kit.LocalJob, upstream_file: Path
) -> None:
    """An upstream family with one of our names (even one the head serves only later) is dropped."""
    try:
        write_atomic(upstream_file, VLLM_PAGE.read_bytes() + CLASHING.encode())
        # The re-export caches the upstream page for 1 s: wait for the marker of the new file.
        text = wait_page(
            job,
            "prefill-0",
            lambda t: "vllm:test_clashing_page_marker{" in t,
            "re-exporting the file with the clashing families",
        )
        families(text)  # no family twice
        sample_map(text)  # no series twice
        assert "not ours" not in text
        got = samples(text)
        assert upstream_up(text) == 1.0
        for name in ("tilert_agent_canary_latency_seconds", "tilert_agent_gate_latency_seconds"):
            assert one(got, name).value < 60
        assert one(got, "tilert_agent_engine_up", component="engine").value == 1.0
        assert list(find(got, "vllm:num_requests_running"))
        check_promtool(text, "prefill-0 with clashing upstream families")
    finally:
        write_atomic(upstream_file, VLLM_PAGE.read_bytes())


# ---- 4. the agents' own series ----------------------------------------------------------------


def test_agent_series_on_every_agent(job: kit.LocalJob) -> None:
    """Engine, process and log series on every agent; head series only on prefill-0."""
    for name, role in AGENTS.items():
        entry = job.agent(name)
        ours = {"role": role, "node": entry["node"], "slurm_job_id": "local"}
        text = page(job, name)
        got = samples(text)
        for s in got:
            assert {k: s.labels.get(k) for k in OURS} == ours, (name, s)
        status = get(entry["status_url"]).json()
        engine = {**ours, "component": "engine"}
        for family in ENGINE_FAMILIES:
            assert list(find(got, family, **engine)), f"{name}: no {family}"
        state = {
            s.labels["state"]: s.value for s in find(got, "tilert_agent_engine_state", **engine)
        }
        assert state[status["state"]] == 1.0, (name, state)
        assert sum(state.values()) == 1.0, (name, state)
        assert one(got, "tilert_agent_engine_up", **engine).value == 1.0
        assert one(got, "tilert_agent_engine_restarts_total", **engine).value == status["restarts"]
        assert one(got, "tilert_agent_probe_latency_seconds_count", **engine).value >= 1
        inf = one(got, "tilert_agent_probe_latency_seconds_bucket", **engine, le="+Inf")
        assert inf.value == one(got, "tilert_agent_probe_latency_seconds_count", **engine).value
        assert 0 < one(got, "tilert_agent_time_to_healthy_seconds", **engine).value < 60
        assert one(got, "tilert_agent_engine_cpu_seconds_total", **engine).value > 0
        rss = one(got, "tilert_agent_engine_resident_memory_bytes", **engine).value
        leader_rss = psutil.Process(status["pid"]).memory_info().rss
        assert leader_rss * 0.5 <= rss <= leader_rss * 4 + 64 * 2**20, (name, rss, leader_rss)
        assert one(got, "tilert_agent_engine_threads", **engine).value >= 1
        assert one(got, "tilert_agent_engine_open_files", **engine).value >= 3  # stdio at least
        assert one(got, "tilert_agent_engine_processes", **engine).value >= 1
        lines = one(got, "tilert_agent_log_lines_total", **engine, outcome="written").value
        size = one(got, "tilert_agent_log_bytes_total", **engine, outcome="written").value
        assert lines >= 1, (name, lines, size)
        assert size >= lines, (name, lines, size)
        assert one(got, "tilert_agent_log_lines_total", **engine, outcome="dropped").value == 0
        assert one(got, "tilert_agent_log_bytes_total", **engine, outcome="dropped").value == 0
        is_head = name == "prefill-0"
        for family in HEAD_FAMILIES:
            assert bool(list(find(got, family))) == is_head, f"{name}: {family}"
        assert bool(list(find(got, "tilert_agent_upstream_up"))) == (role == "prefill")
        if is_head:
            router = {**ours, "component": "router"}
            assert one(got, "tilert_agent_engine_up", **router).value == 1.0
            assert one(got, "tilert_agent_engine_resident_memory_bytes", **router).value > 0
            jobs = {s.labels["state"]: s.value for s in find(got, "tilert_agent_job_state")}
            assert jobs["ready"] == 1.0, jobs
            assert sum(jobs.values()) == 1.0, jobs
            assert 0 <= one(got, "tilert_agent_gate_latency_seconds").value < 60
            assert 0 < one(got, "tilert_agent_canary_latency_seconds").value < 60
        else:
            assert not list(find(got, "tilert_agent_engine_up", component="router"))


# ---- 5. a real Prometheus ---------------------------------------------------------------------


def test_prometheus_scrapes_every_agent(
    job: kit.LocalJob, prometheus_factory: Callable[[Path], PrometheusServer]
) -> None:
    """Through file_sd: up 1 everywhere, vLLM and agent series with our labels, no exported_*."""
    prom = prometheus_factory(job.job / "prometheus" / "targets.json")
    up = prom.wait_for("up", lambda r: len(r) == 3 and all(x["value"][1] == "1" for x in r), 40)
    assert {x["metric"]["agent"] for x in up} == set(AGENTS)
    nodes = {name: job.agent(name)["node"] for name in AGENTS}
    running = prom.wait_for('vllm:num_requests_running{role="prefill"}', timeout=20)
    assert len(running) == 1
    labels = running[0]["metric"]
    assert labels["node"] == nodes["prefill-0"]
    assert labels["slurm_job_id"] == "local"
    assert labels["agent"] == "prefill-0"
    assert labels["engine"] == "0"
    engine_up = prom.wait_for(
        'tilert_agent_engine_up{component="engine"}', lambda r: len(r) == 3, 20
    )
    for series in engine_up:
        m = series["metric"]
        assert m["role"] == AGENTS[m["agent"]], m
        assert m["node"] == nodes[m["agent"]], m
        assert m["slurm_job_id"] == "local", series
        assert series["value"][1] == "1", series
    everything = prom.query('{job="tilert"}')
    assert len(everything) > 300
    exported = [
        s["metric"] for s in everything if any(k.startswith("exported_") for k in s["metric"])
    ]
    assert not exported, exported[:3]
    for target in prom.targets():
        assert target["health"] == "up", target


# ---- 6. safety --------------------------------------------------------------------------------


def test_logs_route_needs_the_token(job: kit.LocalJob) -> None:
    """/logs: 401 without or with a wrong token, 200 with engine lines with J/token."""
    for name in AGENTS:
        base = job.agent(name)["status_url"].removesuffix("/status")
        assert get(f"{base}/logs").status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert get(f"{base}/logs", headers=wrong).status_code == 401
        assert get(f"{base}/logs", headers={"Authorization": job.token()}).status_code == 401
        auth = {"Authorization": f"Bearer {job.token()}"}
        resp = get(f"{base}/logs", headers=auth)
        assert resp.status_code == 200, resp.text
        engine_log = (job.job / "logs" / name / "engine.log").read_text(errors="replace")
        lines = resp.text.splitlines()
        assert lines, (name, lines[:3])
        assert all(line in engine_log for line in lines), (name, lines[:3])
        tail = get(f"{base}/logs", params={"tail": "2"}, headers=auth).text.splitlines()
        assert len(tail) == 2, tail
        assert all(line in engine_log for line in tail), tail


def test_logs_route_serves_only_its_fixed_names(job: kit.LocalJob) -> None:
    """Any name but engine/agent/router (for prefill-0) is 404 and never shows a file's content."""
    token = job.token()
    auth = {"Authorization": f"Bearer {token}"}
    base = job.agent("prefill-0")["status_url"].removesuffix("/status")
    for name in ("engine", "agent", "router"):
        assert get(f"{base}/logs", params={"name": name}, headers=auth).status_code == 200, name
    for name in (
        "../../token",
        "../token",
        str(job.job / "token"),
        "engine.log",
        "agent.stderr.log",
        "../decode-0/engine",
        "plan.json",
        "%2e%2e/token",
    ):
        resp = get(f"{base}/logs", params={"name": name}, headers=auth)
        assert resp.status_code == 404, (name, resp.status_code)
        assert token not in resp.text
    for tail in ("nan", "inf", "-1", "1.5", "abc"):
        resp = get(f"{base}/logs", params={"tail": tail}, headers=auth)
        assert resp.status_code == 400, (tail, resp.status_code, resp.text)
    # follow=1 streams the tail, then keeps the response open for new lines.
    with httpx.stream(
        "GET", f"{base}/logs", params={"tail": "1", "follow": "1"}, headers=auth, timeout=10
    ) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_lines())
    assert first in (job.job / "logs" / "prefill-0" / "engine.log").read_text(errors="replace")
    decode = job.agent("decode-0")["status_url"].removesuffix("/status")
    assert get(f"{decode}/logs", params={"name": "router"}, headers=auth).status_code == 404
    resp = get(f"{base}/logs/../token", headers=auth)
    assert resp.status_code == 404
    assert token not in resp.text


def test_secret_reaches_the_engine_and_nothing_else(job: kit.LocalJob) -> None:
    """HF_TOKEN is in the prefill engine's environment, not in pages, files or any argv."""
    token = job.token()
    for name in AGENTS:
        base = job.agent(name)["status_url"].removesuffix("/status")
        for route in ("/metrics", "/status", "/healthz"):
            text = get(base + route).text
            assert SECRET not in text, (name, route)
            assert token not in text, (name, route)
    for path in job.job.rglob("*"):
        if path.is_file() and path.name != "token":
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in job.output()
    # The submitter's own argv holds it because this test put it there with --set; no process
    # the job started (agents, engines, router) may.
    for proc, cmd in kit.command_lines():
        if proc.pid == job.proc.pid:
            continue
        assert SECRET not in cmd, proc
    pid = get(job.agent("prefill-0")["status_url"]).json()["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={SECRET}".encode() in environ


def test_endpoints_bind_the_nodes_address(job: kit.LocalJob) -> None:
    """Every agent port listens on 127.0.0.1 only (the node's address in local runs)."""
    ports = {int(a["status_url"].rsplit(":", 1)[1].split("/")[0]) for a in job.status()["agents"]}
    listening: dict[int, set[str]] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports:
            listening.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
    assert listening == {port: {"127.0.0.1"} for port in ports}


# ---- 7. tilert-submit logs --------------------------------------------------------------------


def _logs(job: kit.LocalJob, *args: str) -> list[str]:
    done = kit.submit_cmd("logs", str(job.job), *args, env=clean_env(), timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _prefixed(lines: list[str]) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for line in lines:
        name, sep, rest = line.partition(" | ")
        assert sep, f"line without a name prefix: {line!r}"
        by.setdefault(name.strip(), []).append(rest)
    return by


def test_logs_command_prints_every_engine_with_prefixes(job: kit.LocalJob) -> None:
    """``logs J`` prints every source prefixed, ``logs J decode-1`` only that one."""
    every = _prefixed(_logs(job))
    assert list(every) == [*AGENTS, "router"]
    for name in AGENTS:
        on_disk = (job.job / "logs" / name / "engine.log").read_text(errors="replace")
        assert every[name], name
        assert all(line in on_disk for line in every[name]), name
    only = _prefixed(_logs(job, "decode-1"))
    assert list(only) == ["decode-1"]
    assert only["decode-1"][:3] == every["decode-1"][:3]


def test_logs_follow_shows_new_lines_then_sigint_exits_0(job: kit.LocalJob) -> None:
    """``logs J -f`` prints history, then a new request's lines; SIGINT ends it with 0."""
    proc = subprocess.Popen(
        [*kit.SUBMIT, "logs", str(job.job), "-f"],
        cwd=kit.REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []

    def until(what: str, pred: Callable[[list[str]], bool], timeout: float = 15) -> None:
        def printed() -> bool:
            with contextlib.suppress(queue.Empty):
                while True:
                    seen.append(lines.get_nowait().rstrip("\n"))
            return pred(seen)

        kit.wait_for(what, printed, timeout, detail=lambda: f"last lines printed: {seen[-10:]}")

    def prefill_lines(printed: list[str]) -> int:
        return sum(1 for x in printed if x.startswith("prefill-0 |"))

    try:
        until(
            "a line of every source",
            lambda s: {x.split(" | ")[0].strip() for x in s} >= {*AGENTS, "router"},
        )
        # Histories come one source after the other, so prefill-0's is whole once the router's
        # has begun; what its files gained since, the follower prints next. Once every line they
        # hold now is printed, a line more can only come from following.
        on_disk = sum(
            path.read_bytes().count(b"\n")
            for path in (job.job / "logs" / "prefill-0").glob("engine.log*")
        )
        until(f"prefill-0's {on_disk} lines on disk", lambda s: prefill_lines(s) >= on_disk)
        before = prefill_lines(seen)
        router_url = job.status()["router_url"]
        resp = httpx.post(
            f"{router_url}/v1/chat/completions",
            json={"model": "demo-model", "messages": [{"role": "user", "content": "Hello"}]},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        until("a new prefill-0 line after the request", lambda s: prefill_lines(s) > before)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        # The reader ends at the pipe's end; then both pipes are closed (no ResourceWarning).
        reader.join(5)
        stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()


# ---- restarts -------------------------------------------------------------------------------


def test_restart_counter_after_sigkill(job: kit.LocalJob) -> None:
    """SIGKILL decode-1's engine: it comes back healthy and restarts_total becomes 1."""
    status_url = job.agent("decode-1")["status_url"]
    before = get(status_url).json()
    assert before["state"] == "healthy"
    assert before["restarts"] == 0
    os.kill(before["pid"], signal.SIGKILL)
    after = kit.wait_for(
        "decode-1 healthy again after one restart",
        lambda: get(status_url).json(),
        20,
        until=lambda s: s["state"] == "healthy" and s["restarts"] == 1,
        interval=0.1,
    )
    assert after["pid"] != before["pid"]
    assert after["ports"] == before["ports"]
    engine = {"component": "engine", "role": "decode"}
    got = samples(page(job, "decode-1"))
    assert one(got, "tilert_agent_engine_restarts_total", **engine).value == 1.0
    assert one(got, "tilert_agent_engine_up", **engine).value == 1.0
    assert one(got, "tilert_agent_engine_resident_memory_bytes", **engine).value > 0
    other = samples(page(job, "decode-0"))
    assert one(other, "tilert_agent_engine_restarts_total", **engine).value == 0.0
    status = job.wait_state("ready", timeout=20)
    assert job.agent("decode-1")["restarts"] == 1, status


# ---- stop -------------------------------------------------------------------------------------


def test_stop_exits_0_and_leaves_no_process(job_to_stop: kit.LocalJob) -> None:
    """SIGTERM to the submitter: exit 0, every agent and engine gone."""
    code, alive = job_to_stop.stop(STOP_S)
    assert code == 0, job_to_stop.output()
    assert not alive, kit.describe(alive)
    assert job_to_stop.status()["state"] == "stopped"
