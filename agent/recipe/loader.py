"""Recipe YAML -> a resolved, validated ``Recipe``, with every problem reported at once.

Order: YAML syntax (line and column) -> ``--set`` overrides and ``--unset`` -> one ``sweep:``
combination (``agent.recipe.sweep``; the flags come first, so ``--unset sweep`` runs one) ->
shape (unknown keys with "did you mean", wrong types; bad entries pruned) -> ``msgspec.convert``
-> resolution (cluster defaults, image and model aliases, ``hf:`` ids, ``./`` paths, role
layout defaults) -> the load-time rules (``agent.recipe.rules``). Errors from every stage are
raised together in one ``InputError``; warnings ride along in ``LoadedRecipe.warnings``.

``resolved_yaml`` writes what was loaded (aliases resolved, defaults merged, secrets masked) for
``J/recipe.yaml``; agents load it again with ``cluster=None`` and get the same recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from agent.job.secrets import masked
from agent.problems import InputError, Problem, error, errors_of, warning, warnings_of
from agent.recipe import rules
from agent.recipe.cluster import (
    ClusterConfig,
    local_path,
    merged_mounts,
    mount_spec,
    resolve_image,
)
from agent.recipe.model import (
    AgentSection,
    Benchmark,
    Frontend,
    Model,
    Recipe,
    Resources,
    Role,
    Roles,
    Slurm,
    find_arg,
    gpus_per_node,
    role_layout,
)
from agent.recipe.overrides import FLAG, apply_overrides, apply_unsets, parse_override
from agent.recipe.submithost import submit_host_problems
from agent.recipe.sweep import (
    MAX_JOBS,
    SWEEP_KEY,
    Combination,
    apply_combination,
    read_sweep,
    unfilled,
)
from agent.recipe.textfile import read_text
from agent.recipe.typedyaml import (
    KeyPath,
    ShapeChecker,
    YamlSyntaxError,
    convert_problem,
    dotted,
    line_of,
    parse,
    suggest,
    yaml_problem,
)

HF_PREFIX = "hf:"


@dataclass
class LoadedRecipe:
    """A recipe that passed every check, with its warnings and what it was loaded with."""

    recipe: Recipe
    warnings: list[Problem]
    cluster: ClusterConfig | None
    source: str
    # Recipe paths changed by --set, in the order given (for messages and the dry-run printout).
    overridden: list[str] = field(default_factory=list)
    # Roles whose GPU count the recipe left to gpus_per_node (the planner asks a real engine on a
    # CPU-only cluster to say gpus: 0 itself).
    gpus_unset: list[str] = field(default_factory=list)


# srtctl keys tilert-agent refuses with a reason: (struct, key) -> (message, hint).
_SRTCTL_UNSUPPORTED: dict[tuple[type, str], tuple[str, str]] = {
    (Recipe, "profiling"): (
        "profiling is not supported (TileRT does not support torch profiling)",
        "remove profiling",
    ),
    (Recipe, "dynamo"): ("tilert-agent runs no Dynamo", "remove dynamo"),
    (Recipe, "sbatch_directives"): (
        "tilert-agent renders its own sbatch header",
        "use slurm.account / slurm.partition / slurm.time_limit, or the cluster file",
    ),
    (Recipe, "srun_options"): (
        "tilert-agent renders its own srun steps",
        "remove srun_options; pyxis container flags go in agent.pyxis_flags",
    ),
    (Recipe, "observability"): (
        "every agent serves /metrics; J/prometheus/targets.json lists them",
        "remove observability",
    ),
    (Recipe, "services"): ("tilert-agent starts no extra services", "remove services"),
    (Recipe, "identity"): (
        "srtctl's identity is informational (never enforced)",
        "remove identity; pin versions with agent.frameworks (checked on the nodes)",
    ),
    (Recipe, "extra_mount"): ("use container_mounts", "move the mounts to container_mounts"),
    (Recipe, "backend"): (
        "this is srtctl's pre-2.0 layout",
        "run `srtctl migrate -f RECIPE --in-place`, then use roles.<role>.engine/args/env",
    ),
    (Recipe, "infra"): ("this is srtctl's pre-2.0 layout", "run `srtctl migrate` first"),
    (Role, "sidecar"): ("Dynamo sidecars are not supported", "remove sidecar"),
    (Role, "extra_args"): ("extra_args is TRT-LLM only", "put engine flags under args"),
    (Role, "kv_events"): ("KV events are not supported", "remove kv_events"),
    (Role, "srun_options"): ("tilert-agent renders its own srun steps", "remove srun_options"),
    (Role, "critical"): (
        "agents restart a failed engine; a decode that keeps failing is dropped, a prefill fails "
        "the job",
        "remove critical",
    ),
    (Resources, "het_jobs"): ("heterogeneous jobs are not supported", "remove het_jobs"),
    (Resources, "spread_workers"): (
        "decode workers already get one node each",
        "remove spread_workers",
    ),
    (Frontend, "num_additional_frontends"): (
        "tilert-router runs one router (decode busy state lives in it)",
        "remove num_additional_frontends",
    ),
    (Frontend, "nginx_container"): ("no nginx runs in front of the router", "remove it"),
    (Frontend, "placement"): ("the router runs on the prefill node", "remove placement"),
    (Model, "stage_dir"): ("model staging is not supported", "remove stage_dir"),
    (Benchmark, "placement"): ("the client's node is client_placement", "use client_placement"),
    (Benchmark, "aiperf_args"): ("AIPerf's own flags go in extra_args", "use extra_args"),
    (Benchmark, "stream_output"): (
        "the client's output is always in J/logs/benchmark/ (tilert-submit logs J benchmark)",
        "remove stream_output",
    ),
    (Benchmark, "colocate_with_frontend"): (
        "the client runs on a node of the job (client_placement)",
        "use client_placement",
    ),
}
_LEGACY_RESOURCE_KEYS = {
    f"{kind}_{role}" if kind != "gpus_per" else f"gpus_per_{role}"
    for role in ("prefill", "decode", "agg")
    for kind in ("nodes", "workers", "gpus_per")
}


def _advice(cls: type, key: str, path: KeyPath) -> tuple[str, str] | None:
    known = _SRTCTL_UNSUPPORTED.get((cls, key))
    if known is not None:
        message, hint = known
        return f"srtctl key '{key}' is not supported: {message}", hint
    if cls is Resources and (key in _LEGACY_RESOURCE_KEYS or key.endswith(("_nodes", "_workers"))):
        return (
            f"'{key}' is srtctl's pre-2.0 layout",
            "use roles.<role>.nodes / workers / gpus",
        )
    if cls is Role and ("-" in key or key in ("model", "transport")):
        return (
            f"unknown key '{key}' (engine flags are not role keys)",
            f"move it under {dotted((*path, 'args'))}",
        )
    return None


def _model_location(
    value: str, path: str, cluster: ClusterConfig | None, base_dir: Path, out: list[Problem]
) -> str:
    """model.path / frontend model-path: alias, ``hf:`` id, ./ path, absolute path or hub id."""
    if cluster is not None and value in cluster.model_paths:
        return cluster.model_paths[value]
    if value.startswith(HF_PREFIX):
        hub_id = value[len(HF_PREFIX) :].strip()
        if not hub_id:
            out.append(error(path, "'hf:' names no model", "write hf:org/name"))
        return hub_id or value
    local = local_path(value, base_dir)
    if local != value or "/" in value:
        return local
    if cluster is not None:
        aliases = sorted(cluster.model_paths)
        close = suggest(value, aliases)
        out.append(
            error(
                path,
                f"'{value}' is not a model_paths alias in the cluster file, nor a path",
                (f"did you mean '{close}'? " if close else "")
                + "use an alias from model_paths"
                + (f" ({', '.join(aliases)})" if aliases else "")
                + f", an absolute or ./ path, or {HF_PREFIX}{value} for a hub model",
            )
        )
    return value


def _image(
    value: str | None, path: str, cluster: ClusterConfig | None, out: list[Problem]
) -> str | None:
    if value is None:
        return None
    try:
        return resolve_image(value, cluster, path)
    except InputError as exc:
        if cluster is not None and cluster.launcher == "process":
            # Images are not used by the process launcher; keep the recipe loadable (e.g. --mock).
            out.extend(
                msgspec.structs.replace(
                    p,
                    severity="warning",
                    message=p.message + "; ignored by the process launcher",
                )
                for p in exc.problems
            )
            return None
        out.extend(exc.problems)
        return value


def _cluster_defaults(
    recipe: Recipe, cluster: ClusterConfig | None, out: list[Problem]
) -> tuple[Slurm, Resources, Any]:
    """The recipe's slurm section, resources and mounts with the cluster file's defaults."""
    slurm, resources = recipe.slurm, recipe.resources
    mounts = recipe.container_mounts
    if cluster is None:
        return slurm, resources, mounts
    slurm = Slurm(
        account=slurm.account or cluster.default_account,
        partition=slurm.partition or cluster.default_partition,
        time_limit=slurm.time_limit or cluster.default_time_limit,
    )
    if resources.gpu_type is None and cluster.default_gpu_type:
        resources = msgspec.structs.replace(resources, gpu_type=cluster.default_gpu_type)
    if resources.gpus_per_node is None:
        resources = msgspec.structs.replace(resources, gpus_per_node=cluster.gpus_per_node)
    elif cluster.gpus_per_node and cluster.gpus_per_node != resources.gpus_per_node:
        out.append(
            warning(
                "resources.gpus_per_node",
                f"the recipe says {resources.gpus_per_node} GPUs per node, the cluster file "
                f"{cluster.gpus_per_node}; the recipe wins",
                "remove resources.gpus_per_node to use the cluster's value",
            )
        )
    return slurm, resources, merged_mounts(mounts, cluster)


@dataclass
class _Resolver:
    """Resolves a recipe's aliases and local paths against a cluster file and the recipe's folder,
    collecting the problems in ``out``."""

    cluster: ClusterConfig | None
    base_dir: Path
    out: list[Problem]

    def location(self, value: str, key: str) -> str:
        """A model or tokenizer location (see ``_model_location``)."""
        return _model_location(value, key, self.cluster, self.base_dir, self.out)

    def image(self, value: str | None, key: str) -> str | None:
        """A container image (see ``_image``)."""
        return _image(value, key, self.cluster, self.out)

    def mounts(self, mounts: Any) -> Any:
        """Container mounts with their host paths made absolute."""
        if isinstance(mounts, list):
            return [mount_spec(m, self.base_dir) for m in mounts]
        return {local_path(h, self.base_dir): c for h, c in mounts.items()}

    def model(self, model: Model) -> Model:
        """``model.path`` and ``model.container``."""
        if model.path:
            model = msgspec.structs.replace(model, path=self.location(model.path, "model.path"))
        return msgspec.structs.replace(
            model, container=self.image(model.container, "model.container")
        )

    def frontend(self, frontend: Frontend) -> Frontend:
        """The frontend's ``model-path`` argument and its image."""
        found = find_arg(frontend.args, "model-path")
        if found is not None:
            key, value = found
            if isinstance(value, str) and value:
                resolved = self.location(value, f"frontend.args.{key}")
                frontend = msgspec.structs.replace(frontend, args={**frontend.args, key: resolved})
        image = self.image(frontend.container_image, "frontend.container_image")
        return msgspec.structs.replace(frontend, container_image=image)

    def benchmark(self, bench: Benchmark) -> Benchmark:
        """The benchmark's tokenizer and image."""
        if bench.tokenizer:
            tokenizer = self.location(bench.tokenizer, "benchmark.tokenizer")
            bench = msgspec.structs.replace(bench, tokenizer=tokenizer)
        image = self.image(bench.container_image, "benchmark.container_image")
        return msgspec.structs.replace(bench, container_image=image)

    def role(self, name: str, role: Role, node_gpus: int) -> Role:
        """A role with its layout defaults filled, its image and its conversion source."""
        nodes, workers, gpus = role_layout(role, node_gpus)
        role = msgspec.structs.replace(
            role,
            nodes=nodes,
            workers=workers,
            gpus=gpus,
            container=self.image(role.container, f"roles.{name}.container"),
        )
        if role.convert is not None and role.convert.source:
            source = self.location(role.convert.source, f"roles.{name}.convert.source")
            role = msgspec.structs.replace(
                role, convert=msgspec.structs.replace(role.convert, source=source)
            )
        return role


def _resolve(
    recipe: Recipe, cluster: ClusterConfig | None, base_dir: Path, out: list[Problem]
) -> Recipe:
    """Merge cluster defaults and resolve aliases and local paths; fill role layout defaults."""
    replace = msgspec.structs.replace
    resolver = _Resolver(cluster, base_dir, out)
    slurm, resources, mounts = _cluster_defaults(recipe, cluster, out)
    mounts = resolver.mounts(mounts)
    model = resolver.model(recipe.model)
    frontend = resolver.frontend(recipe.frontend)
    bench = resolver.benchmark(recipe.benchmark)
    recipe = replace(
        recipe, slurm=slurm, resources=resources, container_mounts=mounts, benchmark=bench
    )
    node_gpus = gpus_per_node(recipe)
    roles = {}
    for name in ("prefill", "decode", "agg", "aggregated"):
        role: Role | None = getattr(recipe.roles, name)
        roles[name] = None if role is None else resolver.role(name, role, node_gpus)
    if resources.gpus_per_node is None:
        resources = replace(resources, gpus_per_node=node_gpus)
    return replace(
        recipe, model=model, frontend=frontend, roles=Roles(**roles), resources=resources
    )


def _drop_unused(recipe: Recipe) -> Recipe:
    """Remove what the rules accepted but no engine takes (decode served-model-name)."""
    decode = recipe.roles.decode
    found = find_arg(decode.args, "served-model-name") if decode else None
    if decode is None or found is None:
        return recipe
    args = {k: v for k, v in decode.args.items() if k != found[0]}
    roles = msgspec.structs.replace(recipe.roles, decode=msgspec.structs.replace(decode, args=args))
    return msgspec.structs.replace(recipe, roles=roles)


def _under(path: str, prefixes: Sequence[str]) -> str | None:
    for prefix in prefixes:
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            return prefix
    return None


def _raw_recipe(text: str, source: str) -> tuple[Any, dict[str, int], list[Problem]]:
    """The recipe's YAML as a mapping, its lines and the problems parsing found; InputError when
    it is no recipe."""
    try:
        raw, lines, problems = parse(text)
    except YamlSyntaxError as exc:
        raise InputError([yaml_problem(exc)], source) from None
    if raw is None:
        raise InputError(
            [error("", "the recipe is empty", "start from recipes/b200-nixl-glm5.yaml")], source
        )
    if not isinstance(raw, dict):
        raise InputError(
            [
                error(
                    "",
                    "the top level must be a mapping of recipe keys (name:, model:, roles:, ...)",
                    "start from recipes/b200-nixl-glm5.yaml",
                    1,
                )
            ],
            source,
        )
    return raw, lines, problems


def _one_combination(
    raw: dict[str, Any],
    combination: Combination | None,
    *,
    swept: bool,
    problems: list[Problem],
    source: str,
) -> dict[str, Any]:
    """The recipe after the flags, with one sweep combination's values substituted; InputError
    for a sweep left unexpanded. ``swept``: the file had a sweep (the flags may have removed it:
    then each placeholder left without a ``--set`` is a problem)."""
    if combination is not None:
        return apply_combination(raw, combination)
    if SWEEP_KEY in raw:
        raise InputError(
            [
                *problems,
                error(
                    SWEEP_KEY,
                    "this recipe is a sweep: one job per combination of its values",
                    "submit it with tilert-submit RECIPE, which expands the sweep "
                    "(--dry-run lists the jobs)",
                ),
            ],
            source,
        )
    if swept:
        problems += _unfilled(raw)
    return raw


def _typed(raw: Any, problems: list[Problem], source: str) -> tuple[Recipe, Sequence[str]]:
    """The ``Recipe`` from its checked shape, and the paths pruned as bad (their problems are in
    ``problems``)."""
    checker = ShapeChecker(_advice)
    _, cleaned = checker.check(raw, msgspec.inspect.type_info(Recipe))
    problems.extend(checker.problems)
    try:
        recipe = msgspec.convert(cleaned, Recipe)
    except msgspec.ValidationError as exc:  # the walker should have caught it; never a traceback
        raise InputError([*problems, convert_problem(exc)], source) from None
    return recipe, checker.pruned


def _located(
    problems: list[Problem], overridden: Sequence[str], lines: dict[str, int]
) -> list[Problem]:
    """Each problem with its recipe line, or marked as coming from ``--set``."""
    located = []
    for p in problems:
        if _under(p.path, overridden):
            p = msgspec.structs.replace(p, line=None, message=f"{p.message} (from {FLAG})")
        elif p.line is None:
            p = msgspec.structs.replace(p, line=line_of(p.path, lines))
        located.append(p)
    return located


def load_recipe_text(
    text: str,
    *,
    source: str,
    base_dir: Path,
    overrides: Sequence[str] = (),
    unsets: Sequence[str] = (),
    cluster: ClusterConfig | None = None,
    combination: Combination | None = None,
    on_submit_host: bool = True,
) -> LoadedRecipe:
    """Parse, override, check, resolve and validate a recipe; InputError lists every error.

    ``combination``: the values of one combination of the recipe's ``sweep:`` section.
    ``on_submit_host``: False for an agent re-checking ``J/recipe.yaml`` on its node (without
    the cluster file): what only the submit host can check (the cluster's GPU variable, folders
    it sees) was checked there. A srtctl schema-1 recipe (``backend.type: tilert``) is read as
    the schema 2 it means, its problems told in its own keys (agent.recipe.schema1).
    """
    raw, lines, problems = _raw_recipe(text, source)
    swept = SWEEP_KEY in raw
    try:  # the flags first: `--set ... --unset sweep` runs one combination
        raw = apply_unsets(apply_overrides(raw, overrides), unsets)
    except InputError as exc:
        raise InputError([*problems, *exc.problems], source) from None
    overridden = [".".join(parse_override(item)[0]) for item in overrides]
    raw = _one_combination(raw, combination, swept=swept, problems=problems, source=source)
    origins = None
    # The schema-1 reader (600 lines) is imported for a tree that may be one: a recipe that says
    # `schema: 2` is not, and `--dry-run` of one does not pay for it (docs/performance.md,
    # "CLI imports").
    if raw.get("schema") in (None, 1):
        from agent.recipe import schema1

        if schema1.is_schema1(raw):
            raw, origins = schema1.translate(raw)
    found: list[Problem] = []
    typed, pruned = _typed(raw, found, source)
    gpus_unset = [
        name
        for name in ("prefill", "decode")
        if (role := getattr(typed.roles, name)) is not None and role.gpus is None
    ]
    recipe = _resolve(typed, cluster, base_dir, found)
    launcher = cluster.launcher if cluster is not None else None
    found.extend(p for p in rules.check(recipe, launcher=launcher) if not _under(p.path, pruned))
    if on_submit_host:
        found += submit_host_problems(typed, recipe, cluster, base_dir)
    if origins is not None:
        found = [*origins.problems, *(origins.relocate(p) for p in found)]
    problems.extend(found)
    recipe = _drop_unused(recipe)
    located = _located(problems, overridden, lines)
    if errors_of(located):
        raise InputError(located, source)
    return LoadedRecipe(
        recipe=recipe,
        warnings=warnings_of(located),
        cluster=cluster,
        source=source,
        overridden=overridden,
        gpus_unset=gpus_unset,
    )


def _unfilled(raw: dict[str, Any]) -> list[Problem]:
    """A sweep removed by ``--unset sweep``: each placeholder left without a ``--set`` value."""
    return [
        error(
            path,
            f'"{{{name}}}" has no value: the sweep that gave it one was removed (--unset sweep)',
            f"give it with --set {path}=VALUE",
        )
        for name, path in sorted(unfilled(raw).items())
    ]


def recipe_sweep(
    path: Path,
    *,
    overrides: Sequence[str] = (),
    unsets: Sequence[str] = (),
    max_jobs: int = MAX_JOBS,
) -> list[Combination] | None:
    """The combinations of a recipe file's ``sweep:`` section after the ``--set``/``--unset``
    flags (which come first); None when it has none. InputError for a bad sweep or more than
    ``max_jobs`` combinations (counted, not expanded)."""
    text = read_text(path, "recipe")
    try:
        raw, lines, _ = parse(text)
    except YamlSyntaxError as exc:
        raise InputError([yaml_problem(exc)], str(path)) from None
    if not isinstance(raw, dict) or SWEEP_KEY not in raw:
        return None
    try:
        raw = apply_unsets(apply_overrides(raw, overrides), unsets)
    except InputError as exc:
        raise InputError(exc.problems, str(path)) from None
    if SWEEP_KEY not in raw:
        return None
    try:
        return read_sweep(raw, max_jobs)
    except InputError as exc:
        located = [msgspec.structs.replace(p, line=line_of(p.path, lines)) for p in exc.problems]
        raise InputError(located, str(path)) from None


def load_recipe(
    path: Path,
    *,
    overrides: Sequence[str] = (),
    unsets: Sequence[str] = (),
    cluster: ClusterConfig | None = None,
    combination: Combination | None = None,
    on_submit_host: bool = True,
) -> LoadedRecipe:
    """Load a recipe file (relative paths inside it are relative to its folder)."""
    return load_recipe_text(
        read_text(path, "recipe"),
        source=str(path),
        base_dir=path.resolve().parent,
        overrides=overrides,
        unsets=unsets,
        cluster=cluster,
        combination=combination,
        on_submit_host=on_submit_host,
    )


def resolved_dict(loaded: LoadedRecipe) -> dict[str, Any]:
    """The resolved recipe as plain data, secret environment values masked."""
    data: dict[str, Any] = msgspec.to_builtins(loaded.recipe)
    # omit_defaults cannot see default_factory values: drop agent sections left at their defaults
    # (whole sections only, since some have required fields).
    defaults = msgspec.to_builtins(AgentSection())
    agent = {k: v for k, v in data.get("agent", {}).items() if defaults.get(k) != v}
    data.pop("agent", None)
    if agent:
        data["agent"] = agent
    if "environment" in data:
        data["environment"] = masked(data["environment"])
    for role in data.get("roles", {}).values():
        if "env" in role:
            role["env"] = masked(role["env"])
    for section in (data.get("frontend", {}), data.get("benchmark", {})):
        if "env" in section:
            section["env"] = masked(section["env"])
    return data


def resolved_yaml(loaded: LoadedRecipe) -> str:
    """YAML for J/recipe.yaml: aliases resolved, cluster defaults merged, secrets masked."""
    header = (
        f"# Resolved by tilert-agent from {loaded.source}: aliases resolved, cluster defaults "
        "merged,\n# secret environment values masked (agents take them from their environment).\n"
    )
    body = yaml.safe_dump(
        resolved_dict(loaded),
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    return header + body
