"""Preflight: seconds-long checks on the node, through the engine's launcher, before the long load.

What only a compute node can know (docs/design.md): does the engine's interpreter (inside the image,
with the job's mounts) find the modules the engine needs, which tilert/vllm versions it has, does
the setup script exist, do the weights exist. One short ``python -c`` program answers all of it
with one JSON line; it imports nothing of ours, because it runs inside the engine image.

The setup script is located as the engine would see it (``<configs_dir>/<script>``, then
``<configs_dir>/patches/<script>``; one policy for workers and the router: missing is a failure)
and *sourced* before the checks, exactly as it is before the engine, because a setup script may
be what installs a module the checks look for.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import replace

import msgspec

from agent.launch.spec import Launcher, LaunchSpec, RunTimeout
from agent.problems import printable

RESULT_PREFIX = "TILERT_PREFLIGHT "
SETUP_FAILED_PREFIX = "TILERT_PREFLIGHT_SETUP_FAILED "
OUTPUT_TAIL_LINES = 15


class PreflightChecks(msgspec.Struct, kw_only=True, frozen=True):
    """What one engine needs on its node."""

    # The engine's interpreter: "python3" inside an image; the engine's own with the process
    # launcher (agent.launch.interpreter); for a stand-in the agent's sys.executable.
    python: str
    modules: list[str] = []
    # Distributions whose versions are recorded (absent ones are not an error).
    distributions: list[str] = []
    # The recipe's setup_script (a file name looked up under configs_dir), or None.
    setup_script: str | None = None
    configs_dir: str = "/configs"
    # Paths that must exist as the engine sees them (weights directory, absolute model paths).
    paths: list[str] = []
    # Modules looked for without failing (what the agent decides on: is a real tilert there?).
    optional_modules: list[str] = []
    # Programs that must be found on the engine's PATH (a program that is not a Python script).
    programs: list[str] = []


class PreflightResult(msgspec.Struct, kw_only=True):
    """The outcome: ok, every problem (what, where it looked, what to do), versions, the script."""

    ok: bool
    problems: list[str]
    versions: dict[str, str]
    setup_script: str | None
    # Each optional module: found or not.
    optional: dict[str, bool] = {}


class _Report(msgspec.Struct):
    """The JSON line the program prints."""

    python: str
    executable: str
    modules: dict[str, str | None]
    versions: dict[str, str]
    missing_paths: list[str]
    setup_script: str | None
    programs: dict[str, str | None] = {}
    path: str = ""


# Runs in the engine's interpreter: standard library only, Python 3.6+ syntax.
PROGRAM = r"""
import importlib.util, json, os, shutil, sys
spec = json.loads(sys.argv[1])
modules = {}
for name in spec["modules"] + spec["optional_modules"]:
    try:
        modules[name] = None if importlib.util.find_spec(name) is not None else "not found"
    except BaseException as exc:  # a parent package that fails to import says why
        modules[name] = "%s: %s" % (type(exc).__name__, exc)
versions = {}
try:
    import importlib.metadata as md
    for dist in spec["distributions"]:
        try:
            versions[dist] = md.version(dist)
        except Exception:
            pass
except ImportError:
    pass
report = {
    "python": sys.version.split()[0],
    "executable": sys.executable,
    "modules": modules,
    "versions": versions,
    "missing_paths": [p for p in spec["paths"] if not os.path.exists(p)],
    "setup_script": sys.argv[2] or None,
    "programs": dict((p, shutil.which(p)) for p in spec["programs"]),
    "path": os.environ.get("PATH", ""),
}
sys.stdout.flush()
print("TILERT_PREFLIGHT " + json.dumps(report), flush=True)
"""

# Find the setup script, source it (as before the engine), then become the program. Variable
# names are unlikely ones because the sourced script shares the shell.
_SETUP_THEN_PROGRAM = (
    '__tilert_py=$1; __tilert_prog=$2; __tilert_spec=$3; shift 3; __tilert_found=""; '
    'for __tilert_c in "$@"; do '
    'if [ -f "$__tilert_c" ]; then __tilert_found=$__tilert_c; break; fi; done; '
    'if [ -n "$__tilert_found" ]; then . "$__tilert_found" </dev/null || '
    '{ echo "' + SETUP_FAILED_PREFIX + '$? $__tilert_found"; exit 97; }; fi; '
    'exec "$__tilert_py" -c "$__tilert_prog" "$__tilert_spec" "$__tilert_found"'
)


def setup_script_candidates(script: str, configs_dir: str) -> list[str]:
    """Where a setup script is looked up, in order (an absolute name is only itself)."""
    if posixpath.isabs(script):
        return [script]
    return [posixpath.join(configs_dir, script), posixpath.join(configs_dir, "patches", script)]


def preflight_argv(checks: PreflightChecks) -> list[str]:
    """The one command the preflight runs (bash only when a setup script must be sourced)."""
    spec = json.dumps(
        {
            "modules": checks.modules,
            "optional_modules": checks.optional_modules,
            "distributions": checks.distributions,
            "paths": checks.paths,
            "programs": checks.programs,
        }
    )
    if checks.setup_script is None:
        return [checks.python, "-c", PROGRAM, spec, ""]
    candidates = setup_script_candidates(checks.setup_script, checks.configs_dir)
    return [
        "bash", "-c", _SETUP_THEN_PROGRAM, "tilert-preflight",
        checks.python, PROGRAM, spec, *candidates,
    ]  # fmt: skip


def _tail(output: bytes) -> str:
    lines = [ln for ln in output.decode(errors="replace").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(RESULT_PREFIX)][-OUTPUT_TAIL_LINES:]
    return printable(" | ".join(lines)) if lines else "(no output)"


def _where(spec: LaunchSpec, checks: PreflightChecks) -> str:
    base = f"{checks.python!r}"
    return f"{base} in image {spec.image}" if spec.image else base


def _failed(problem: str) -> PreflightResult:
    return PreflightResult(ok=False, problems=[problem], versions={}, setup_script=None)


async def run_preflight(
    launcher: Launcher, spec_base: LaunchSpec, checks: PreflightChecks, timeout_s: float = 60
) -> PreflightResult:
    """Run the checks through ``launcher`` with ``spec_base``'s env, image and mounts."""
    spec = replace(spec_base, argv=preflight_argv(checks), setup_script=None)
    where = _where(spec, checks)
    shown = shlex.join([checks.python, "-c", "<preflight>"])
    try:
        code, output = await launcher.run(spec, timeout_s=timeout_s)
    except RunTimeout as exc:
        setup = (
            f" (this includes sourcing the setup script {checks.setup_script})"
            if checks.setup_script
            else ""
        )
        return _failed(
            f"the preflight ({shown} through the {launcher.name} launcher) did not finish within "
            f"{timeout_s:g}s{setup}; the node, file system or image is too slow or stuck: "
            f"check it by hand. Last output: {_tail(exc.output)}"
        )
    except OSError as exc:
        return _failed(
            f"cannot start the engine's interpreter {where} through the {launcher.name} launcher: "
            f"{exc}; fix the interpreter "
            "(agent.prefill_command, decode_python or router_python, or "
            "the image) or the engine's PATH"
        )
    text = output.decode(errors="replace")
    for line in text.splitlines():
        if line.startswith(SETUP_FAILED_PREFIX):
            status, _, path = line[len(SETUP_FAILED_PREFIX) :].partition(" ")
            return PreflightResult(
                ok=False,
                problems=[
                    f"the setup script {path} (recipe setup_script) failed with status {status} "
                    f"when sourced before the checks; fix the script. Output: {_tail(output)}"
                ],
                versions={},
                setup_script=path or None,
            )
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return _failed(
            f"the preflight printed no result (exit status {code}): the interpreter {where} "
            f"did not start or crashed; the engine would too. Output: {_tail(output)}"
        )
    try:
        report = msgspec.json.decode(lines[-1][len(RESULT_PREFIX) :], type=_Report)
    except msgspec.DecodeError as exc:
        return _failed(f"the preflight printed an unreadable result ({exc}): {lines[-1][:200]}")
    return _judge(report, checks, where)


def _judge(report: _Report, checks: PreflightChecks, where: str) -> PreflightResult:
    problems: list[str] = []
    for program, found in report.programs.items():
        if found is None:
            problems.append(
                f"program {program!r} is not found on the engine's PATH ({report.path}) as "
                f"{where} sees it; install it there, or name the program by its absolute path "
                "(agent.prefill_command), or set PATH in the role's env"
            )
    for module, error in report.modules.items():
        if module in checks.optional_modules:
            continue
        if error is not None:
            problems.append(
                f"module {module} cannot be found by {where} ({report.executable}, Python "
                f"{report.python}): {error}; install it into that environment (the image, "
                "or the setup script), or point the role at an image that has it"
            )
    if checks.setup_script is not None and report.setup_script is None:
        looked = " and ".join(setup_script_candidates(checks.setup_script, checks.configs_dir))
        problems.append(
            f"setup script {checks.setup_script!r} (recipe setup_script) not found: looked in "
            f"{looked} as the engine sees them (cluster file configs_dir, the job's mounts); "
            "put the script there, mount it, or fix setup_script"
        )
    for path in report.missing_paths:
        problems.append(
            f"{path} does not exist as the engine sees it ({where}, with the job's mounts); "
            "fix the path in the recipe (weights directory / model path) or mount it "
            "(cluster file mounts)"
        )
    versions = {"python": report.python, **report.versions}
    optional = {m: report.modules.get(m) is None for m in checks.optional_modules}
    return PreflightResult(
        ok=not problems,
        problems=problems,
        versions=versions,
        setup_script=report.setup_script,
        optional=optional,
    )
