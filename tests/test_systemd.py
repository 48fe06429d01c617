"""The systemd units in systemd/ pass ``systemd-analyze verify`` and fit the agent's contracts."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

from agent.recipe.cluster import ClusterConfig
from tests.conftest import require

UNITS = Path(__file__).resolve().parent.parent / "systemd"
SERVICE = "tilert-agent@.service"
TARGET = "tilert-agents.target"
INSTALLED_AGENT = "/usr/local/bin/tilert-agent"
INSTANCES = ("prefill-0", "decode-1")


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
