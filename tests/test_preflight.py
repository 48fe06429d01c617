"""The preflight through the real process launcher, with real interpreters and files."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from agent.launch import LaunchSpec, ProcessLauncher
from agent.launch.enginechecks import engine_checks, pin_problems, pinned
from agent.launch.preflight import PreflightChecks, run_preflight
from agent.recipe.cluster import ClusterConfig
from agent.recipe.loader import load_recipe
from agent.recipe.planner import make_plan

DEMO = Path(__file__).resolve().parent.parent / "recipes" / "local-demo.yaml"
BASE = LaunchSpec(name="decode-0-preflight", argv=[], env=dict(os.environ))


def checks(**kw: object) -> PreflightChecks:
    """Checks with the test's own interpreter unless told otherwise."""
    kw.setdefault("python", sys.executable)
    return PreflightChecks(**kw)  # type: ignore[arg-type]


async def test_found_modules_and_versions() -> None:
    result = await run_preflight(
        ProcessLauncher(),
        BASE,
        checks(
            modules=["json", "msgspec", "agent.standins.decode"],
            distributions=["msgspec", "no-such-dist-xyz"],
        ),
    )
    assert result.ok, result.problems
    assert result.problems == []
    assert result.versions == {
        "python": platform.python_version(),
        "msgspec": importlib.metadata.version("msgspec"),
    }
    assert result.setup_script is None


async def test_missing_module_is_a_clear_failure() -> None:
    result = await run_preflight(
        ProcessLauncher(), BASE, checks(modules=["json", "no_such_module_xyz.decode_server"])
    )
    assert not result.ok
    [problem] = result.problems
    assert "no_such_module_xyz.decode_server" in problem
    assert sys.executable in problem
    assert "install it" in problem


async def test_setup_script_found_in_configs_dir_and_sourced(tmp_path: Path) -> None:
    # The setup script is what makes the module findable: the checks run after sourcing it.
    lib = tmp_path / "lib"
    (lib / "fromsetup").mkdir(parents=True)
    (lib / "fromsetup" / "__init__.py").write_text("")
    (tmp_path / "setup.sh").write_text(f'export PYTHONPATH="{lib}"\n')
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "setup.sh").write_text("return 1\n")  # never reached
    result = await run_preflight(
        ProcessLauncher(),
        BASE,
        checks(modules=["fromsetup"], setup_script="setup.sh", configs_dir=str(tmp_path)),
    )
    assert result.ok, result.problems
    assert result.setup_script == str(tmp_path / "setup.sh")


async def test_setup_script_found_in_patches(tmp_path: Path) -> None:
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "fix.sh").write_text("echo patched\n")
    result = await run_preflight(
        ProcessLauncher(), BASE, checks(setup_script="fix.sh", configs_dir=str(tmp_path))
    )
    assert result.ok, result.problems
    assert result.setup_script == str(tmp_path / "patches" / "fix.sh")


async def test_missing_setup_script_is_a_failure(tmp_path: Path) -> None:
    result = await run_preflight(
        ProcessLauncher(), BASE, checks(setup_script="gone.sh", configs_dir=str(tmp_path))
    )
    assert not result.ok
    [problem] = result.problems
    assert "setup_script" in problem
    assert str(tmp_path / "gone.sh") in problem
    assert str(tmp_path / "patches" / "gone.sh") in problem
    assert result.setup_script is None


async def test_failing_setup_script(tmp_path: Path) -> None:
    (tmp_path / "setup.sh").write_text("echo 'pip: no network' >&2; false\n")
    result = await run_preflight(
        ProcessLauncher(), BASE, checks(setup_script="setup.sh", configs_dir=str(tmp_path))
    )
    assert not result.ok
    [problem] = result.problems
    assert "failed with status 1" in problem
    assert "pip: no network" in problem


async def test_missing_weights_dir(tmp_path: Path) -> None:
    present, absent = tmp_path, tmp_path / "weights"
    result = await run_preflight(ProcessLauncher(), BASE, checks(paths=[str(present), str(absent)]))
    assert not result.ok
    [problem] = result.problems
    assert problem.startswith(f"{absent} does not exist")


async def test_all_problems_at_once(tmp_path: Path) -> None:
    result = await run_preflight(
        ProcessLauncher(),
        BASE,
        checks(
            modules=["no_such_a", "no_such_b"],
            setup_script="none.sh",
            configs_dir=str(tmp_path),
            paths=[str(tmp_path / "w")],
        ),
    )
    # Every problem at once: two modules, the setup script, the path.
    assert len(result.problems) == 4
    assert "none.sh" in result.problems[2]
    assert str(tmp_path / "w") in result.problems[3]


async def test_interpreter_that_cannot_start() -> None:
    result = await run_preflight(ProcessLauncher(), BASE, checks(python="/nonexistent/python3"))
    assert not result.ok
    [problem] = result.problems
    assert "cannot start" in problem
    assert "/nonexistent/python3" in problem


async def test_interpreter_that_cannot_start_after_setup(tmp_path: Path) -> None:
    (tmp_path / "s.sh").write_text("true\n")
    result = await run_preflight(
        ProcessLauncher(),
        BASE,
        checks(python="/nonexistent/python3", setup_script="s.sh", configs_dir=str(tmp_path)),
    )
    assert not result.ok
    [problem] = result.problems
    assert "printed no result" in problem
    assert "/nonexistent/python3" in problem


async def test_timeout_is_a_failure(tmp_path: Path) -> None:
    slow = tmp_path / "python3"
    slow.write_text("#!/bin/sh\necho loading\nexec sleep 600\n")
    slow.chmod(0o755)
    result = await run_preflight(ProcessLauncher(), BASE, checks(python=str(slow)), timeout_s=0.5)
    assert not result.ok
    [problem] = result.problems
    assert "did not finish within 0.5s" in problem
    assert "loading" in problem


async def test_a_pinned_version_the_interpreter_has_otherwise_fails_naming_both() -> None:
    """agent.frameworks (schema 1's identity.frameworks) against what the preflight really
    found: the engine, the image, the package, the pinned and the found version."""
    plan = make_plan(
        load_recipe(
            DEMO,
            cluster=ClusterConfig(launcher="process"),
            overrides=["agent.frameworks={msgspec: '0.0.1', no-such-dist-xyz: '1.0'}"],
        )
    )
    checks = engine_checks(plan, "prefill", dict(os.environ))
    assert {"msgspec", "no-such-dist-xyz"} <= set(checks.distributions)
    result = await run_preflight(
        ProcessLauncher(),
        BASE,
        PreflightChecks(python=sys.executable, distributions=checks.distributions),
    )
    found = importlib.metadata.version("msgspec")
    problems = pin_problems(pinned(plan), result.versions, image="img:1", engine="prefill")
    assert problems == [
        f"prefill: image img:1 has msgspec {found}, the recipe pins msgspec 0.0.1 "
        "(agent.frameworks; schema 1: identity.frameworks): use an image with msgspec==0.0.1, "
        "or change the pin"
    ]
    # The same pin, met: nothing to say (a requirement spelling is the same version).
    assert pin_problems({"msgspec": f"=={found}"}, result.versions, image=None, engine="x") == []
