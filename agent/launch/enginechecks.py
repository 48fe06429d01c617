"""What the preflight checks for one engine: the program and interpreter that will run it.

With the process launcher the checks run with the engine's own interpreter and environment (the
role's env included, so a recipe's PYTHONPATH counts): the interpreter is the program itself when
it is a Python (``agent.decode_python``, ``[python, -m, vllm.entrypoints.openai.api_server]``),
else the one its ``#!`` line names (a venv's ``vllm`` script); a program that names none (a
site's launcher script) is checked for existence on the engine's PATH only. Under pyxis the checks
run inside the engine's image. A stand-in is checked with the agent's own interpreter.

The recipe's version pins (``agent.frameworks``) are compared with the versions the preflight
found in each real engine's image (``pin_problems``); stand-ins are not the images and are not
compared.

The TileRT connector stand-in (``agent.standins.vllm_connector``) is decided here too: asked for
with ``TILERT_STANDIN_CONNECTOR=1`` in the prefill's environment, allowed only beside stand-in
decodes, and used only when the engine's interpreter has no real ``tilert``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from agent.facts import CONNECTOR_MODULE, DECODE_MODULE, ENGINE_DISTRIBUTIONS
from agent.facts import STANDIN_CONNECTOR_PATH as CONNECTOR_PATH
from agent.facts import STANDIN_CONNECTOR_SWITCH as SWITCH
from agent.job.plan import Plan
from agent.job.vocab import Process, Role
from agent.launch.engineflags import Flag, FlagQuestion, help_argvs, vllm_program
from agent.launch.interpreter import is_python, python_of
from agent.launch.preflight import PreflightChecks, PreflightResult

# What the connector stand-in needs in vLLM's environment (vLLM brings msgspec).
CONNECTOR_STANDIN_MODULES = ("trio", "msgspec")
# An interpreter inside an image (no PATH of ours to resolve it with).
IMAGE_PYTHON = "python3"


def standin_connector_asked(env: Mapping[str, str]) -> bool:
    """Whether the prefill's environment asks for the connector stand-in."""
    return env.get(SWITCH, "").strip() == "1"


def _paths(plan: Plan, role: Role) -> list[str]:
    """Paths the engine needs that must exist as it sees them (an absolute model).

    The decode's weights folder is not one: the weights gate checks it (and converts it when the
    recipe says so) after the preflight (docs/weights.md)."""
    role_plan = plan.role(role)
    paths = []
    model = role_plan.program[-1] if role == "prefill" else ""
    if model.startswith("/"):
        paths.append(model)
    return paths


def engine_checks(plan: Plan, role: Role, env: Mapping[str, str]) -> PreflightChecks:
    """The preflight of ``role``'s engine, run with ``env`` (the engine's own environment)."""
    role_plan = plan.role(role)
    if plan.standin(role):
        return PreflightChecks(
            python=sys.executable,
            modules=[f"agent.standins.{role}"],
            distributions=list(ENGINE_DISTRIBUTIONS),
            # The stand-ins need no setup; the script belongs to the real images.
            setup_script=None,
            configs_dir=plan.configs_dir,
        )
    in_image = plan.launcher == "pyxis" and role_plan.image is not None
    # The prefill's program is agent.prefill_command + MODEL; the decode's decode_python -m ...
    program = role_plan.program[0]
    programs = [] if is_python(program) else [program]
    if in_image:
        python: str | None = program if is_python(program) else IMAGE_PYTHON
    else:
        python = python_of(program, env.get("PATH"))
    if role == "decode":
        modules = [DECODE_MODULE]
    elif standin_connector_asked(env):
        modules = ["vllm", *CONNECTOR_STANDIN_MODULES]
    else:
        modules = ["vllm", CONNECTOR_MODULE]
    optional = (
        ["tilert", CONNECTOR_MODULE] if role == "prefill" and standin_connector_asked(env) else []
    )
    distributions = list(dict.fromkeys([*ENGINE_DISTRIBUTIONS, *pinned(plan)]))
    if python is None:
        # A site's launcher: nothing names its Python, so only the program can be checked.
        python, modules, optional = IMAGE_PYTHON if in_image else sys.executable, [], []
    return PreflightChecks(
        python=python,
        modules=modules,
        optional_modules=optional,
        distributions=distributions,
        setup_script=plan.setup_script,
        configs_dir=plan.configs_dir,
        paths=_paths(plan, role),
        programs=programs,
    )


def pinned(plan: Plan) -> dict[str, str]:
    """The recipe's version pins (agent.frameworks): package -> version; {} without."""
    return {} if isinstance(plan.frameworks, msgspec.UnsetType) else dict(plan.frameworks)


def pin_problems(
    pins: Mapping[str, str], found: Mapping[str, str], *, image: str | None, engine: str
) -> list[str]:
    """Each pinned package the engine's image has in another version, named with both.

    A package the image does not have is not a mismatch (the decode image has no vLLM): the
    engine's own package missing is the preflight's module check already.
    """
    where = f"image {image}" if image else "the engine's interpreter"
    problems = []
    for package, want in pins.items():
        have = found.get(package)
        if have is not None and _version(have) != _version(want):
            problems.append(
                f"{engine}: {where} has {package} {have}, the recipe pins {package} {want} "
                "(agent.frameworks; schema 1: identity.frameworks): use an image with "
                f"{package}=={want}, or change the pin"
            )
    return problems


def _version(text: str) -> str:
    # Pins are written as versions ("0.1.6.post3") or requirements ("==0.1.6.post3").
    return text.strip().removeprefix("==").strip().lower()


@dataclass(frozen=True)
class ConnectorChoice:
    """Whether the prefill gets the connector stand-in, and why (or why the job cannot run)."""

    use_standin: bool
    problem: str | None
    note: str


def connector_choice(
    plan: Plan, env: Mapping[str, str], result: PreflightResult
) -> ConnectorChoice:
    """The connector stand-in decision for a real prefill after its preflight."""
    if plan.standin("prefill") or not standin_connector_asked(env):
        return ConnectorChoice(False, None, "")
    if not plan.standin("decode"):
        return ConnectorChoice(
            False,
            f"{SWITCH}=1 asks for the TileRT connector stand-in, which sends no KV, but the "
            "decodes are real TileRT: they would wait out their KV timeout on every request; "
            "run the decodes as stand-ins (--mock decode) or remove the setting",
            "",
        )
    if result.optional.get("tilert"):
        if not result.optional.get(CONNECTOR_MODULE):
            return ConnectorChoice(
                False,
                f"{SWITCH}=1, but the engine's interpreter has a real tilert package without "
                f"{CONNECTOR_MODULE}; the stand-in never shadows a real tilert: fix or remove "
                "that installation, or remove the setting",
                "",
            )
        return ConnectorChoice(
            False,
            None,
            f"{SWITCH}=1 ignored: the engine's interpreter has a real tilert, which the "
            "stand-in never shadows",
        )
    return ConnectorChoice(
        True, None, f"the TileRT connector stand-in is on vLLM's PYTHONPATH ({CONNECTOR_PATH})"
    )


def with_standin_connector(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the connector stand-in first on PYTHONPATH."""
    out = dict(env)
    rest = out.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(CONNECTOR_PATH), rest) if p)
    return out


# Each program the flag check asks: (engine as messages name it, the distribution of its version).
_FLAG_ENGINES = {
    "prefill": ("vLLM", "vllm"),
    "decode": ("the TileRT decode server", "tilert"),
    "router": ("the TileRT router", "tilert"),
}
# Where each program's recipe arguments are written.
_ARGS_KEYS = {
    "prefill": "roles.prefill.args",
    "decode": "roles.decode.args",
    "router": "frontend.args",
}


def _source_fingerprint(module: str) -> str:
    """A stand-in's source file as size and mtime: its cached flags follow its code."""
    try:
        spec = importlib.util.find_spec(module)
        info = os.stat(spec.origin) if spec is not None and spec.origin else None
    except (ImportError, OSError, ValueError):
        return ""
    return f"{info.st_size}-{info.st_mtime_ns}" if info is not None else ""


def flag_question(plan: Plan, name: Process, argv: Sequence[str], *, standin: bool) -> FlagQuestion:
    """What to ask ``name``'s program (its own help) and which flags of ``argv`` to check.

    ``argv`` is the command the agent will run; each long flag is named by where it comes from:
    the recipe's args, ``agent.prefill_command``, or the agent itself."""
    engine, distribution = _FLAG_ENGINES[name]
    if name == "router":
        args, program = plan.router.args, plan.router.program
    else:
        args, program = plan.role(name).args, plan.role(name).program
    from_args = {w for w in args if w.startswith("--")}
    # The prefill's program is agent.prefill_command + MODEL.
    from_program = {w for w in program[:-1] if w.startswith("--")} if name == "prefill" else set()
    flags = []
    for word in argv:
        if not word.startswith("--") or len(word) < 3:
            continue
        if word in from_args:
            origin = f"{_ARGS_KEYS[name]}.{word[2:]}"
        elif word in from_program:
            origin = "agent.prefill_command"
        else:
            origin = f"{word} (passed by tilert-agent itself)"
        flags.append(Flag(word, origin))
    if standin:
        # A stand-in's argv starts [python, -m, MODULE] (+ serve for the prefill): commands.py.
        base = list(argv[:4]) if name == "prefill" else list(argv[:3])
        return FlagQuestion(
            engine=f"{engine} stand-in",
            help_argvs=help_argvs(base, vllm=name == "prefill"),
            distribution=distribution,
            flags=flags,
            standin=True,
            fingerprint=_source_fingerprint(base[2]),
        )
    if name != "prefill":
        return FlagQuestion(engine, help_argvs(program, vllm=False), distribution, flags)
    served = vllm_program(plan.prefill.program[:-1])
    if served is None:
        return FlagQuestion(
            engine,
            [],
            distribution,
            flags,
            not_asked=(
                f"agent.prefill_command ({' '.join(plan.prefill.program[:-1])}) is neither "
                "`vllm serve` nor `python -m vllm...`: vLLM's flags are not checked before the load"
            ),
        )
    return FlagQuestion(engine, help_argvs(served, vllm=True), distribution, flags, lenient=True)
