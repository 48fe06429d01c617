"""srtctl's load-time rules, and the failures srtctl sees only late, moved before sbatch.

What srtctl itself refuses when it loads a schema-2 recipe (identity, engines, frontend, topology),
plus what would fail only on the nodes: an arg the agent manages, no model, no image for pyxis, a
setting out of range. Each function appends its problems to ``out``; ``agent.recipe.rules.check``
calls them in a fixed order so that the report reads the same on every run.
"""

from __future__ import annotations

import re

from agent.facts import (
    DECODE_ENGINE,
    MANAGED_ARGS,
    PREFILL_ENGINE,
    ROUTER_MANAGED_ARGS,
    ROUTER_PARSERS,
    ROUTER_TYPE,
    strict_int,
)
from agent.problems import Problem, error, warning
from agent.recipe.model import (
    Recipe,
    Role,
    engine_type,
    find_arg,
    gpus_per_node,
    norm_arg,
    role_layout,
)
from agent.recipe.rules.values import is_hub_id

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# The job directory is <name>-<yyyymmdd-hhmmss>: one path component of at most 255 bytes.
NAME_MAX_CHARS = 128
# What exec can pass as an environment name (control characters are refused by the loader).
_ENV_NAME = re.compile(r"^[^=\s]+$")


def identity(recipe: Recipe, out: list[Problem]) -> None:
    """The job name (it names the job directory and the Slurm job) and the schema version."""
    if not recipe.name:
        out.append(
            error(
                "name",
                "the recipe has no name (it names the job directory and the Slurm job)",
                "add name: my-job",
            )
        )
    elif not _NAME.match(recipe.name):
        out.append(
            error(
                "name",
                f"'{recipe.name}' is not a usable job name",
                "use letters, digits, '.', '_' and '-' only, starting with a letter or digit",
            )
        )
    elif len(recipe.name) > NAME_MAX_CHARS:
        out.append(
            error(
                "name",
                f"the job name has {len(recipe.name)} characters, more than {NAME_MAX_CHARS}",
                "use a shorter name (it names the job directory and the Slurm job)",
            )
        )
    if recipe.schema is not None and recipe.schema != 2:
        out.append(
            error(
                "schema",
                f"schema {recipe.schema} is not supported; tilert-agent reads srtctl schema 2",
                "set schema: 2 (run `srtctl migrate` on a schema 1 recipe first)",
            )
        )


def _roles(recipe: Recipe) -> list[tuple[str, Role]]:
    roles = [("prefill", recipe.roles.prefill), ("decode", recipe.roles.decode)]
    return [(name, role) for name, role in roles if role is not None]


def engines(recipe: Recipe, out: list[Problem]) -> None:
    """vLLM prefill and TileRT decode engines, set per role (never one top-level engine)."""
    roles = _roles(recipe)
    fix = (
        f"remove the top-level engine; set roles.prefill.engine: {PREFILL_ENGINE} and "
        f"roles.decode.engine: {DECODE_ENGINE}"
    )
    if recipe.engine is not None:
        with_role = [name for name, role in roles if role.engine is not None]
        if with_role:
            message = (
                "a top-level engine cannot be combined with "
                + ", ".join(f"roles.{name}.engine" for name in with_role)
                + " (srtctl rejects this even when the types match)"
            )
        else:
            message = "one engine for every role cannot serve vLLM prefill + TileRT decode"
        out.append(error("engine", message, fix))
        return
    for name, role in roles:
        want = PREFILL_ENGINE if name == "prefill" else DECODE_ENGINE
        path = f"roles.{name}.engine"
        if role.engine is None:
            out.append(
                error(
                    path,
                    "every role needs an engine when there is no top-level engine",
                    f"add engine: {want} to roles.{name}",
                )
            )
            continue
        kind = engine_type(role.engine)
        if kind is None:
            out.append(
                error(path, "an engine mapping needs a string 'type'", f"write engine: {want}")
            )
            continue
        if kind != want:
            what = "vLLM prefill" if name == "prefill" else "a TileRT decode engine"
            out.append(
                error(
                    path,
                    f"{ROUTER_TYPE} needs {what}; got engine type '{kind}'",
                    f"set {path}: {want}",
                )
            )
        if isinstance(role.engine, dict):
            for key in role.engine:
                if key not in ("type", "served_model_name"):
                    out.append(
                        warning(
                            f"{path}.{key}",
                            "engine options other than 'type' are not used by tilert-agent",
                            f"remove it; engine flags go under roles.{name}.args",
                        )
                    )


def frontend(recipe: Recipe, out: list[Problem]) -> None:
    """TileRT's router as the one frontend, with a model folder and a parser it has."""
    frontend = recipe.frontend
    if frontend.type is None:
        out.append(
            error(
                "frontend.type",
                "no frontend type (srtctl's default is dynamo, which tilert-agent does not run)",
                f"set frontend.type: {ROUTER_TYPE}",
            )
        )
    elif frontend.type != ROUTER_TYPE:
        out.append(
            error(
                "frontend.type",
                f"frontend type '{frontend.type}' is not served by tilert-agent: it runs TileRT's "
                "P/D router only (Dynamo, sglang-router, vllm-router and direct frontends are "
                "srtctl's)",
                f"set frontend.type: {ROUTER_TYPE}",
            )
        )
    if frontend.enable_multiple_frontends:
        out.append(
            error(
                "frontend.enable_multiple_frontends",
                f"{ROUTER_TYPE} runs one router (decode busy state lives in that process)",
                "set frontend.enable_multiple_frontends: false",
            )
        )
    for key in frontend.args:
        why = ROUTER_MANAGED_ARGS.get(norm_arg(key))
        if why is not None:
            out.append(error(f"frontend.args.{key}", f"{why}; it cannot be set", "remove it"))
    model_path = find_arg(frontend.args, "model-path")
    if model_path is None:
        out.append(
            error(
                "frontend.args.model-path",
                "the router needs the tokenizer and generation_config.json (streaming fails "
                "mid-stream without it, also with parser: none)",
                "set frontend.args.model-path to the model folder as the router sees it "
                "(e.g. /model, or the same path as model.path)",
            )
        )
    else:
        key, value = model_path
        path = f"frontend.args.{key}"
        if not isinstance(value, str) or not value:
            out.append(error(path, "expected a path", "write a folder path"))
        elif is_hub_id(value):
            out.append(
                warning(
                    path,
                    f"'{value}' looks like a hub id: the router downloads it when it starts, and "
                    "compute nodes without internet access fail then",
                    "download the model once and point model-path at the folder (absolute, or "
                    "./ relative to the recipe)",
                )
            )
    parser = find_arg(frontend.args, "parser")
    if parser is None:
        out.append(
            warning(
                "frontend.args.parser",
                "not set: the router's default glm47 parser needs vLLM installed in the router "
                "image",
                "set parser: none, or parser: glm47 when the router image has vLLM",
            )
        )
    elif parser[1] not in ROUTER_PARSERS:
        out.append(
            error(
                f"frontend.args.{parser[0]}",
                f"the router accepts parser {' or '.join(ROUTER_PARSERS)}, not {parser[1]!r}",
                "set parser: none (or glm47)",
            )
        )


def topology(recipe: Recipe, out: list[Problem]) -> None:
    """One prefill worker on one node; one decode worker per node; workers fit a node."""
    node_gpus = gpus_per_node(recipe)
    for name in ("agg", "aggregated"):
        if getattr(recipe.roles, name) is not None:
            out.append(
                error(
                    f"roles.{name}",
                    "aggregated workers are not supported: tilert-router serves one vLLM "
                    "prefill and TileRT decode workers",
                    f"remove roles.{name}; use roles.prefill and roles.decode",
                )
            )
    prefill, decode = recipe.roles.prefill, recipe.roles.decode
    if prefill is None:
        out.append(error("roles.prefill", "a vLLM prefill role is required", "add roles.prefill"))
    else:
        nodes, workers, gpus = role_layout(prefill, node_gpus)
        if workers != 1:
            out.append(
                error(
                    "roles.prefill.workers",
                    f"{ROUTER_TYPE} needs exactly one prefill worker (got {workers})",
                    "set roles.prefill.workers: 1",
                )
            )
        if nodes > 1:
            out.append(
                error(
                    "roles.prefill.nodes",
                    "a prefill on more than one node is not supported yet (vLLM would expose one "
                    "API per node, and the router takes one)",
                    "set roles.prefill.nodes: 1 and use tensor parallelism inside the node",
                )
            )
        elif nodes < 1:
            out.append(error("roles.prefill.nodes", "must be 1", "set roles.prefill.nodes: 1"))
        _gpus_fit("prefill", gpus, node_gpus, out)
    if decode is None:
        out.append(error("roles.decode", "a TileRT decode role is required", "add roles.decode"))
    else:
        nodes, workers, gpus = role_layout(decode, node_gpus)
        if workers < 1:
            out.append(
                error(
                    "roles.decode.workers",
                    f"{ROUTER_TYPE} needs at least one decode worker",
                    "set roles.decode.workers: 1 (or more)",
                )
            )
        elif nodes != workers:
            out.append(
                error(
                    "roles.decode.nodes",
                    f"decode nodes ({nodes}) must equal decode workers ({workers}): one agent "
                    "and one TileRT decode server per node, and a decode worker cannot span nodes",
                    f"set roles.decode.nodes: {workers}",
                )
            )
        _gpus_fit("decode", gpus, node_gpus, out)


def _gpus_fit(name: str, gpus: int, node_gpus: int, out: list[Problem]) -> None:
    if gpus > node_gpus:
        out.append(
            error(
                f"roles.{name}.gpus",
                f"a {name} worker must fit on one node: {gpus} GPUs per worker > "
                f"gpus_per_node {node_gpus}",
                f"set roles.{name}.gpus to at most {node_gpus}",
            )
        )
    elif gpus < 0:
        # Derived from nodes and workers (their own ranges keep it >= 0 after loading).
        out.append(error(f"roles.{name}.gpus", "must not be negative", f"set it to {node_gpus}"))


def environment(recipe: Recipe, out: list[Problem]) -> None:
    """Environment names exec can pass: no ``=``, no blank (the engine would fail to start)."""
    sections = [
        ("environment", recipe.environment),
        *((f"roles.{name}.env", role.env) for name, role in _roles(recipe)),
        ("frontend.env", recipe.frontend.env),
    ]
    for where, env in sections:
        for name in env:
            if not _ENV_NAME.match(name):
                out.append(
                    error(
                        f"{where}.{name}",
                        f"'{name}' is not an environment variable name",
                        "use letters, digits and '_', e.g. HF_HUB_OFFLINE",
                    )
                )


def managed_args(recipe: Recipe, out: list[Problem]) -> None:
    """No engine arg that the agent passes itself (hosts, ports, --engine, the model)."""
    for name, role in _roles(recipe):
        for key in role.args:
            managed = MANAGED_ARGS.get((name, norm_arg(key)))
            if managed is not None:
                why, fix = managed
                out.append(error(f"roles.{name}.args.{key}", why, fix))


def model(recipe: Recipe, out: list[Problem]) -> None:
    """A model for vLLM to serve; a hub id is a warning (compute nodes may be offline)."""
    path = recipe.model.path
    if not path:
        out.append(
            error(
                "model.path",
                "no model: vLLM serves model.path",
                "set model.path to a folder, a cluster model_paths alias, or hf:org/name",
            )
        )
    elif is_hub_id(path):
        out.append(
            warning(
                "model.path",
                f"'{path}' is a hub id: vLLM downloads it on the prefill node when it starts, and "
                "compute nodes without internet access fail then",
                "download it once and use its folder or a cluster model_paths alias",
            )
        )


# A first run on a new cluster often has no images yet: the other launcher is worth knowing about.
_PROCESS_HINT = (
    "or, with the engines installed on the nodes, set launcher: process in the cluster file "
    "(tilert-submit init writes one; docs/launchers.md)"
)


def images(recipe: Recipe, launcher: str | None, out: list[Problem]) -> None:
    """An image for every engine and the router when the pyxis launcher runs them."""
    # Only the pyxis launcher runs images; the process launcher (and an unknown launcher, when a
    # node re-checks an already resolved recipe) has nothing to require.
    if launcher != "pyxis":
        return
    shared = recipe.model.container
    for name, role in _roles(recipe):
        if not (role.container or shared):
            out.append(
                error(
                    f"roles.{name}.container",
                    f"no image for the {name} engine (the pyxis launcher runs every engine in one)",
                    f"set roles.{name}.container or model.container; {_PROCESS_HINT}",
                )
            )
    if not (recipe.frontend.container_image or shared):
        out.append(
            error(
                "frontend.container_image",
                "no image for the router (the pyxis launcher runs it in one)",
                f"set frontend.container_image or model.container; {_PROCESS_HINT}",
            )
        )


def _programs(recipe: Recipe, out: list[Problem]) -> None:
    """The commands and interpreters the agent starts, and where engines keep their scratch."""
    agent = recipe.agent
    if not agent.prefill_command:
        out.append(
            error(
                "agent.prefill_command",
                "is empty: the agent needs a program to start vLLM with",
                "remove it to use `vllm serve`, or write e.g. "
                "[python, -m, vllm.entrypoints.openai.api_server]",
            )
        )
    for i, word in enumerate(agent.prefill_command):
        if not word.strip():
            out.append(
                error(
                    f"agent.prefill_command[{i}]",
                    "is blank",
                    "every word of the command must be a non-empty string",
                )
            )
    for path, python in (
        ("agent.decode_python", agent.decode_python),
        ("agent.router_python", agent.router_python),
    ):
        if not python.strip() or python != python.strip():
            out.append(
                error(
                    path,
                    f"{python!r} is not an interpreter",
                    "name a python executable (on the engine's PATH, or an absolute path)",
                )
            )
    scratch = agent.scratch_dir
    if scratch is not None and scratch != "job" and not scratch.startswith("/"):
        out.append(
            error(
                "agent.scratch_dir",
                f"{scratch!r} is neither `job` nor an absolute path",
                "remove it (a per-job folder under the node's temp folder), write `job` (under "
                "the job directory), or an absolute node-local path",
            )
        )


def settings(recipe: Recipe, out: list[Problem]) -> None:
    """The agent's paths and programs, the prefill's GPU count (numbers are in range already:
    their types in the model)."""
    agent = recipe.agent
    if not agent.logs.node_dir.startswith("/"):
        out.append(
            error(
                "agent.logs.node_dir",
                f"{agent.logs.node_dir!r} is not an absolute path",
                "name a folder on each node's local disk, e.g. /tmp/tilert-logs",
            )
        )
    _programs(recipe, out)
    prefill = recipe.roles.prefill
    if prefill is not None:
        _, _, gpus = role_layout(prefill, gpus_per_node(recipe))
        tp = find_arg(prefill.args, "tensor-parallel-size")
        pp = find_arg(prefill.args, "pipeline-parallel-size")
        tp_n = strict_int(tp[1]) if tp else 1
        pp_n = strict_int(pp[1]) if pp else 1
        if gpus and tp_n and pp_n and tp_n * pp_n != gpus:
            out.append(
                warning(
                    "roles.prefill.gpus",
                    f"the prefill holds {gpus} GPUs but vLLM uses tensor x pipeline parallel "
                    f"{tp_n} x {pp_n} = {tp_n * pp_n}",
                    "make roles.prefill.gpus equal to tensor-parallel-size x "
                    "pipeline-parallel-size",
                )
            )
