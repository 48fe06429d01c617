"""What runs an engine, checked as it will run: the interpreter of a program, the preflight of an
engine (with its own environment), the TileRT connector stand-in decision, the scratch folders."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import msgspec
import pytest

from agent.facts import CONNECTOR_MODULE
from agent.facts import STANDIN_CONNECTOR_PATH as CONNECTOR_PATH
from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan
from agent.launch import LaunchSpec, ProcessLauncher, preflight
from agent.launch.commands import decode_command, prefill_command
from agent.launch.enginechecks import (
    connector_choice,
    engine_checks,
    with_standin_connector,
)
from agent.launch.interpreter import is_python, python_of
from agent.launch.preflight import PreflightResult
from agent.launch.scratch import SCRATCH_ENV, Scratch, scratch_root, socket_path_problem
from tests.kit import make_job


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """The demo's --mock plan."""
    return load_plan((make_job(tmp_path_factory.mktemp("checks")) / "plan.json").read_bytes())


def real(plan: Plan, standins: list[str] | None = None) -> Plan:
    """``plan`` with only ``standins`` as stand-ins (none by default)."""
    return msgspec.structs.replace(plan, standins=standins or [])


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---- interpreter -------------------------------------------------------------------------------


def test_a_python_is_its_own_interpreter() -> None:
    for name in ("python", "python3", "python3.11", "/venv/bin/python3.12"):
        assert is_python(name)
        assert python_of(name, "") == name
    assert not is_python("vllm")
    assert not is_python("pythonista")


def test_a_console_script_names_its_interpreter(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script(bin_dir / "vllm", f"#!{bin_dir}/python3.11\nimport sys\n")
    # Found on the ENGINE's PATH, not the agent's.
    assert python_of("vllm", str(bin_dir)) == f"{bin_dir}/python3.11"
    assert python_of("vllm", "/nonexistent") is None
    script(bin_dir / "via-env", "#!/usr/bin/env -S python3\n")
    assert python_of("via-env", f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin") is not None
    script(bin_dir / "launcher", '#!/bin/bash\nexec vllm serve "$@"\n')
    assert python_of(str(bin_dir / "launcher"), "") is None


# ---- the engine's preflight ----------------------------------------------------------------------


def test_a_stand_in_is_checked_with_the_agents_interpreter(plan: Plan) -> None:
    checks = engine_checks(plan, "decode", {})
    assert checks.python == sys.executable
    assert checks.modules == ["agent.standins.decode"]
    assert checks.setup_script is None


def test_the_decode_is_checked_with_decode_python(plan: Plan) -> None:
    decode = msgspec.structs.replace(plan.decode, program=["/opt/t/bin/python", "-m", "x"])
    checks = engine_checks(msgspec.structs.replace(real(plan), decode=decode), "decode", {})
    assert checks.python == "/opt/t/bin/python"
    assert checks.modules == ["tilert.pd_vllm.decode_server"]
    assert checks.programs == []


def test_the_prefill_is_checked_with_its_scripts_interpreter_and_env(
    plan: Plan, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script(bin_dir / "vllm", f"#!{sys.executable}\n")
    prefill = msgspec.structs.replace(plan.prefill, program=["vllm", "serve", "/models/m"])
    p = msgspec.structs.replace(real(plan), prefill=prefill)
    checks = engine_checks(p, "prefill", {"PATH": str(bin_dir)})
    assert checks.python == sys.executable
    assert checks.modules == ["vllm", CONNECTOR_MODULE]
    assert checks.programs == ["vllm"]
    assert checks.paths == ["/models/m"]
    # A launcher that names no Python: only the program can be checked.
    script(bin_dir / "site-vllm", "#!/bin/sh\n")
    prefill = msgspec.structs.replace(plan.prefill, program=["site-vllm", "/models/m"])
    checks = engine_checks(
        msgspec.structs.replace(p, prefill=prefill), "prefill", {"PATH": str(bin_dir)}
    )
    assert checks.modules == []
    assert checks.programs == ["site-vllm"]


async def test_the_preflight_runs_with_the_engines_pythonpath(plan: Plan, tmp_path: Path) -> None:
    # A module only the role's PYTHONPATH provides, as roles.prefill.env.PYTHONPATH would.
    (tmp_path / "lib" / "vllm").mkdir(parents=True)
    (tmp_path / "lib" / "vllm" / "__init__.py").write_text("")
    prefill = msgspec.structs.replace(
        plan.prefill,
        program=[sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
        env={"PYTHONPATH": str(tmp_path / "lib")},
    )
    p = msgspec.structs.replace(real(plan, ["decode"]), prefill=prefill)
    env = prefill_command(p, name="prefill-0", host="127.0.0.1", http_port=1).env
    env["TILERT_STANDIN_CONNECTOR"] = "1"
    checks = engine_checks(p, "prefill", env)
    spec = LaunchSpec(name="pf", argv=[], env=env)
    result = await preflight.run_preflight(ProcessLauncher(), spec, checks)
    assert result.ok, result.problems
    assert result.optional == {"tilert": False, CONNECTOR_MODULE: False}
    choice = connector_choice(p, env, result)
    assert choice.use_standin
    assert choice.problem is None
    # Without the role's PYTHONPATH the same check fails and says where it looked.
    del env["PYTHONPATH"]
    result = await preflight.run_preflight(ProcessLauncher(), LaunchSpec("pf", [], env), checks)
    assert not result.ok
    assert "module vllm cannot be found" in result.problems[0]


def result(**optional: bool) -> PreflightResult:
    return PreflightResult(ok=True, problems=[], versions={}, setup_script=None, optional=optional)


def test_the_connector_stand_in_is_only_used_when_asked_beside_stand_in_decodes(plan: Plan) -> None:
    asked = {"TILERT_STANDIN_CONNECTOR": "1"}
    none = result(tilert=False)
    assert not connector_choice(real(plan, ["decode"]), {}, none).use_standin
    assert connector_choice(real(plan, ["decode"]), asked, none).use_standin
    refused = connector_choice(real(plan), asked, none)
    assert not refused.use_standin
    assert "--mock decode" in (refused.problem or "")
    # Never shadows a real tilert.
    shadow = connector_choice(
        real(plan, ["decode"]), asked, result(tilert=True, **{CONNECTOR_MODULE: True})
    )
    assert not shadow.use_standin
    assert shadow.problem is None
    assert "ignored" in shadow.note
    broken = connector_choice(real(plan, ["decode"]), asked, result(tilert=True))
    assert not broken.use_standin
    assert CONNECTOR_MODULE in (broken.problem or "")
    env = with_standin_connector({"PYTHONPATH": "/site"})
    assert env["PYTHONPATH"] == f"{CONNECTOR_PATH}{os.pathsep}/site"
    assert (CONNECTOR_PATH / "tilert" / "pd_vllm" / "prefill_connector.py").is_file()


# ---- scratch -------------------------------------------------------------------------------------


def test_every_engine_gets_its_own_scratch_and_the_recipe_wins(plan: Plan) -> None:
    agent_env = {"PATH": "/usr/bin", "HOME": "/home/u"}
    cmd = decode_command(
        plan,
        name="decode-0",
        address="a",
        http_port=1,
        ctrl_port=2,
        scratch="/s/d0",
        agent_env=agent_env,
    )
    for name, sub in SCRATCH_ENV.items():
        assert cmd.env[name] == f"/s/d0/{sub}"
    # The hub cache stays where it was: weights are not downloaded again.
    assert cmd.env["HF_HOME"] == "/home/u/.cache/huggingface"
    prefill = msgspec.structs.replace(plan.prefill, env={"TMPDIR": "/fast"})
    p = msgspec.structs.replace(plan, prefill=prefill)
    env = prefill_command(
        p, name="prefill-0", host="h", http_port=1, scratch="/s/p0", agent_env=agent_env
    ).env
    assert env["TMPDIR"] == "/fast"
    assert env["VLLM_CACHE_ROOT"] == "/s/p0/cache/vllm"
    assert (
        "TMPDIR"
        not in prefill_command(plan, name="prefill-0", host="h", http_port=1, agent_env={}).env
    )


def test_scratch_lives_under_the_system_temp_and_is_removed(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "jobs" / "demo-1")
    root = scratch_root(job, None, temp_dir=str(tmp_path / "systemp"))
    assert root.parent == tmp_path / "systemp"
    assert len(root.name) == len("tilert-") + 10
    assert scratch_root(job, "job") == job.root / "scratch"
    assert scratch_root(job, "/local/ssd").parent == Path("/local/ssd")
    mine, other = Scratch(root, "prefill-0"), Scratch(root, "decode-0")
    folder = Path(mine.folder("engine"))
    assert (folder / "tmp").is_dir()
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    other.folder("engine")
    mine.remove()
    assert not mine.path.exists()
    assert root.exists()  # decode-0 still uses the job's root
    other.remove()
    assert not root.exists()
    assert list((tmp_path / "systemp").iterdir()) == []


def test_a_tmpdir_too_long_for_vllms_sockets_is_refused() -> None:
    assert socket_path_problem({"TMPDIR": "/tmp/tilert-0123456789/prefill-0/engine/tmp"}) is None
    problem = socket_path_problem({"TMPDIR": "/x" * 40})
    assert problem
    assert "agent.scratch_dir" in problem
    assert "107" in problem
