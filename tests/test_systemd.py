"""The systemd units in systemd/ pass ``systemd-analyze verify``, rate 5.0 or lower on
``systemd-analyze security --offline=yes``, and fit the agent's contracts (docs/systemd.md)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

from agent.node.servicenotes import EXTEND_BY_S, EXTEND_EVERY_S
from agent.recipe.cluster import ClusterConfig
from agent.recipe.model import ServiceFrontSettings
from tests.conftest import require

UNITS = Path(__file__).resolve().parent.parent / "systemd"
SERVICE = "tilert-agent@.service"
TARGET = "tilert-agents.target"
INSTALLED_AGENT = "/usr/local/bin/tilert-agent"
INSTANCES = ("prefill-0", "decode-1")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "systemd.md"
MAX_EXPOSURE = 5.0  # issue 21: systemd-analyze security rates the unit 5.0 or lower


def venv_agent() -> Path:
    """The tilert-agent console script next to this interpreter (the project is installed)."""
    return Path(sys.executable).parent / "tilert-agent"


def read_unit(name: str) -> configparser.ConfigParser:
    """A unit file as sections of keys (repeated keys keep the last value)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / name)
    return parser


def test_units_verify_cleanly(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    agent = venv_agent()
    assert agent.exists(), f"{agent} missing: install the project (pip install -e .)"
    # verify checks that ExecStart's program exists: point the copy at the installed script.
    text = (UNITS / SERVICE).read_text()
    assert INSTALLED_AGENT in text
    (tmp_path / SERVICE).write_text(text.replace(INSTALLED_AGENT, str(agent)))
    shutil.copy(UNITS / TARGET, tmp_path / TARGET)
    units = [str(tmp_path / f"tilert-agent@{i}.service") for i in INSTANCES]
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units, str(tmp_path / TARGET)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    ours = [line for line in output.splitlines() if "tilert" in line]
    assert not ours, output


def instance_copy(tmp_path: Path, text: str) -> Path:
    """The service written under ``tmp_path`` with ExecStart on the installed console script; the
    path of its ``decode-0`` instance (what systemd-analyze reads)."""
    (tmp_path / SERVICE).write_text(text.replace(INSTALLED_AGENT, str(venv_agent())))
    return tmp_path / "tilert-agent@decode-0.service"


def exposure(unit: Path) -> tuple[float, int]:
    """``systemd-analyze security --offline=yes --threshold=50`` on ``unit``: the overall
    exposure (0-10) and the exit code (non-zero above 5.0)."""
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=50", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", done.stdout + done.stderr)
    assert found, done.stdout + done.stderr
    return float(found.group(1)), done.returncode


def test_security_exposure_is_at_most_5(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    figure, code = exposure(instance_copy(tmp_path, (UNITS / SERVICE).read_text()))
    assert figure <= MAX_EXPOSURE, figure
    assert code == 0
    # docs/systemd.md and the unit's comment give the figure: keep them true.
    assert f"-> {figure} OK" in (UNITS / SERVICE).read_text()
    assert f"**{figure} OK**" in DOCS.read_text()


def test_unhardened_unit_fails_the_security_check(tmp_path: Path) -> None:
    # The check above can fail: without the hardening block the unit is back to 9.6 UNSAFE.
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    text = (UNITS / SERVICE).read_text()
    bare = text[: text.index("# ---- Hardening")] + text[text.index("[Install]") :]
    figure, code = exposure(instance_copy(tmp_path, bare))
    assert figure > MAX_EXPOSURE, figure
    assert code != 0
    assert "**9.6 UNSAFE**" in DOCS.read_text()


def test_hardening_leaves_what_the_engines_need() -> None:
    """GPU and RDMA device nodes, pinned memory, the network, sd_notify, scratch and caches."""
    service = read_unit(SERVICE)["Service"]
    lines = (UNITS / SERVICE).read_text().splitlines()
    allowed = {line.split("=", 1)[1] for line in lines if line.startswith("DeviceAllow=")}
    for device in ("nvidia-frontend", "nvidia-uvm", "kfd", "drm", "infiniband_verbs"):
        assert f"char-{device} rw" in allowed, device
    assert "/dev/infiniband/rdma_cm rw" in allowed
    assert service.get("PrivateDevices", "no") == "no"
    assert service["LimitMEMLOCK"] == "infinity"
    assert "CAP_IPC_LOCK" in service["CapabilityBoundingSet"].split()
    families = service["RestrictAddressFamilies"].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)  # sd_notify, ZMQ; HTTP, KV
    assert service.get("PrivateNetwork", "no") == "no"
    assert service["ProtectSystem"] != "strict"  # the job folder lives wherever the site says
    assert service["ProtectHome"] in ("no", "read-only")
    assert service["SystemCallErrorNumber"] == "EPERM"  # a denied call fails, it does not kill
    assert "MemoryDenyWriteExecute" not in service  # triton, torch inductor, CUDA JIT


def test_notify_settings_fit_the_agent() -> None:
    service = read_unit(SERVICE)["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"  # the engines' notes (if any) are not the agent's
    watchdog_s = int(service["WatchdogSec"])
    # The agent pets at half of it; the first extension comes long before the start timeout.
    assert watchdog_s >= 2 * 10
    assert int(service["TimeoutStartSec"]) >= EXTEND_EVERY_S
    assert EXTEND_BY_S > EXTEND_EVERY_S


def test_broken_unit_fails_verify(tmp_path: Path) -> None:
    # The check above can fail: a typo and a missing program are reported.
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    text = (UNITS / SERVICE).read_text().replace("KillMode=control-group", "KillMode=groupp")
    (tmp_path / SERVICE).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / "tilert-agent@decode-0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "kill mode" in output
    assert "not executable" in output


def test_service_settings_fit_the_agent() -> None:
    service = read_unit(SERVICE)["Service"]
    assert service["KillMode"] == "control-group"
    assert service["Restart"] == "on-failure"
    # Exit code 2 is bad input (docs/cli.md): a restart cannot fix it.
    assert service["RestartPreventExitStatus"] == "2"
    # systemd must not SIGKILL the agent while it still stops its engines within kill_wait_s.
    stop_s = int(service["TimeoutStopSec"])
    assert stop_s > ClusterConfig().kill_wait_s
    exec_start = service["ExecStart"].split()
    assert exec_start[0] == INSTALLED_AGENT
    assert exec_start[1:] == [
        "--role",
        "${TILERT_ROLE}",
        "--job-dir",
        "${TILERT_JOB_DIR}",
        "--index",
        "${TILERT_INDEX}",
    ]
    unit = read_unit(SERVICE)["Unit"]
    assert unit["PartOf"] == TARGET
    assert read_unit(SERVICE)["Install"]["WantedBy"] == TARGET


def test_example_env_file_defines_what_exec_start_uses() -> None:
    used = set(re.findall(r"\$\{(\w+)\}", read_unit(SERVICE)["Service"]["ExecStart"]))
    example = (UNITS / "agent.env.example").read_text()
    defined = set(re.findall(r"^(\w+)=", example, re.MULTILINE))
    assert used
    assert used <= defined


def test_agent_accepts_the_unit_flags() -> None:
    agent = venv_agent()
    done = subprocess.run([str(agent), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--role", "--job-dir", "--index"):
        assert flag in done.stdout


# ---- the service front's units (tilert-service.service + .socket, docs/service.md) -----------

FRONT_SERVICE = "tilert-service.service"
FRONT_SOCKET = "tilert-service.socket"
INSTALLED_SUBMIT = "/usr/local/bin/tilert-submit"
SERVICE_DOCS = DOCS.parent / "service.md"


def front_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The service front's units under ``tmp_path``, ExecStart on the installed tilert-submit;
    the service's path."""
    submit = Path(sys.executable).parent / "tilert-submit"
    assert submit.exists(), f"{submit} missing: install the project (pip install -e .)"
    text = (UNITS / FRONT_SERVICE).read_text() if text is None else text
    assert INSTALLED_SUBMIT in text
    (tmp_path / FRONT_SERVICE).write_text(text.replace(INSTALLED_SUBMIT, str(submit)))
    shutil.copy(UNITS / FRONT_SOCKET, tmp_path / FRONT_SOCKET)
    return tmp_path / FRONT_SERVICE


def test_the_service_front_units_verify_cleanly(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    service = front_copy(tmp_path)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(service), str(tmp_path / FRONT_SOCKET)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not [line for line in output.splitlines() if "tilert" in line], output


def test_the_service_front_is_hardened_and_says_its_figure(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed")
    text = (UNITS / FRONT_SERVICE).read_text()
    figure, code = exposure(front_copy(tmp_path))
    assert figure <= MAX_EXPOSURE, figure
    assert code == 0
    assert f"-> {figure} OK" in text
    assert f"**{figure} OK**" in SERVICE_DOCS.read_text()
    # The check can fail: without its hardening block the unit is unsafe.
    bare = text[: text.index("# ---- Hardening")] + text[text.index("[Install]") :]
    (tmp_path / "bare").mkdir()
    figure, code = exposure(front_copy(tmp_path / "bare", bare))
    assert figure > MAX_EXPOSURE, figure
    assert code != 0
    assert f"{figure} UNSAFE -> " in text


def test_the_service_front_unit_fits_serve() -> None:
    """Type=notify (serve says READY once a cell serves), SIGTERM to the front alone (it stops
    its cells), time for the cells to drain, the socket held by systemd, the env file's
    variables defined in the example, and an address that is the recipe's default."""
    service = read_unit(FRONT_SERVICE)["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["KillMode"] == "mixed"
    assert service["RestartPreventExitStatus"] == "2"
    assert int(service["TimeoutStopSec"]) > 2 * ClusterConfig().kill_wait_s
    exec_start = service["ExecStart"].split()
    assert exec_start[:2] == [INSTALLED_SUBMIT, "serve"]
    used = set(re.findall(r"\$\{(\w+)\}", service["ExecStart"]))
    example = (UNITS / "service.env.example").read_text()
    defined = set(re.findall(r"^(\w+)=", example, re.MULTILINE))
    assert used
    assert used <= defined
    unit = read_unit(FRONT_SERVICE)["Unit"]
    assert unit["Requires"] == FRONT_SOCKET
    socket_unit = read_unit(FRONT_SOCKET)["Socket"]
    assert socket_unit["Accept"] == "no"
    assert socket_unit["Service"] == FRONT_SERVICE
    default = ServiceFrontSettings()
    assert socket_unit["ListenStream"] == f"{default.host}:{default.port}"
