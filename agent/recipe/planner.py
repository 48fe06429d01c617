"""Recipe + cluster -> ``Plan`` (``J/plan.json``): deterministic, nothing secret, no timestamps.

The plan holds each engine's program and the user's arguments rendered as argv, *without* what the
agent manages (hosts, ports, ``--engine``, the router's ``--vllm-url`` / ``--decode``): those are
added by ``agent.launch.commands`` once ports are chosen on the node. The same input always gives
the same plan, byte for byte, so a golden test can pin it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from agent.facts import DECODE_MODULE, DEFAULT_TILERT_MODEL, ROUTER_MODULE
from agent.job import vocab
from agent.job.benchmark import BenchmarkPlan
from agent.job.plan import (
    LAUNCHERS,
    AgentPlan,
    DecodePlan,
    LauncherName,
    Plan,
    RolePlan,
    RouterPlan,
    SlurmPlan,
)
from agent.job.secrets import is_secret_name
from agent.job.vocab import PROCESSES, Process
from agent.problems import InputError, error
from agent.recipe.benchplan import benchmark_plan
from agent.recipe.cluster import ClusterConfig
from agent.recipe.convertplan import convert_plan
from agent.recipe.loader import HF_PREFIX, LoadedRecipe
from agent.recipe.model import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_MAX_ATTEMPTS,
    AgentSection,
    ArgValue,
    EnvValue,
    Recipe,
    Role,
    canary_attempt_s,
    env_value,
    find_arg,
    gpus_per_node,
    norm_arg,
    public_model_name,
    role_env,
    role_layout,
)

# The agent section's own defaults: a recipe that sets one role's budget or grace leaves the
# others None, and they fall back to these (one source for every default).
_AGENT_DEFAULTS = AgentSection()

# Slurm SIGKILLs every task max(KillWait, 5) s after the SIGTERM of a scancel or time limit.
SLURM_MIN_KILL_WAIT_S = 5.0
# What the drain needs besides the engines' graces: sweeping leftover descendants, writing the
# last status.json, exiting.
DRAIN_MARGIN_S = 2.0


def render_value(value: Any) -> str:
    """One argv word for a YAML value: mappings and lists as compact JSON, booleans lowercase."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return str(value)


def render_args(args: Mapping[str, ArgValue]) -> list[str]:
    """``--key value`` per arg: true -> bare flag; false/null/[] dropped; a list -> flag + items."""
    argv: list[str] = []
    for key, value in args.items():
        # Canonical dashes: vLLM accepts either spelling, TileRT's argparse only the dashed one.
        flag = "--" + norm_arg(key)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            if value:
                argv += [flag, *(render_value(item) for item in value)]
        else:
            argv += [flag, render_value(value)]
    return argv


def split_env(env: Mapping[str, EnvValue]) -> tuple[dict[str, str], list[str]]:
    """(non-secret values as the engine sees them, secret names) of an environment."""
    plain = {k: env_value(v) for k, v in env.items() if not is_secret_name(k)}
    secrets = [k for k in env if is_secret_name(k)]
    return plain, secrets


def secret_values(recipe: Recipe) -> dict[str, str]:
    """Secret env values in the recipe (they travel in the sbatch process env, never a file)."""
    layers: list[Mapping[str, EnvValue]] = [recipe.environment, recipe.frontend.env]
    layers += [role.env for role in (recipe.roles.prefill, recipe.roles.decode) if role]
    return {k: env_value(v) for layer in layers for k, v in layer.items() if is_secret_name(k)}


def health_check_budget_s(recipe: Recipe) -> float:
    """srtctl's startup budget: health_check max_attempts x interval_seconds (with its defaults)."""
    hc = recipe.health_check
    attempts = hc.max_attempts if hc.max_attempts is not None else DEFAULT_HEALTH_MAX_ATTEMPTS
    interval = hc.interval_seconds if hc.interval_seconds is not None else DEFAULT_HEALTH_INTERVAL_S
    return float(attempts * interval)


def _startup_budget(recipe: Recipe, role: Process) -> float:
    value = getattr(recipe.agent.startup_budget_s, role)
    if value is not None:
        return float(value)
    if role == "router":
        return float(_AGENT_DEFAULTS.startup_budget_s.router or 0.0)
    return health_check_budget_s(recipe)


def _requested_grace(recipe: Recipe, role: Process) -> float:
    value = getattr(recipe.agent.stop_grace_s, role)
    if value is None:
        value = getattr(_AGENT_DEFAULTS.stop_grace_s, role)
    return float(value or 0.0)


def stop_graces(recipe: Recipe, kill_wait_s: float) -> dict[str, float]:
    """Per-role SIGTERM->SIGKILL graces, capped so each agent's whole drain fits in KillWait.

    On scancel every task gets SIGTERM at once and SIGKILL ``max(KillWait, 5)`` s later. A decode
    agent drains one engine: its grace alone must fit. The prefill agent stops the router first
    (in-flight requests still reference the prefill), then vLLM, so router + prefill must fit
    together; when they do not, both shrink in proportion. ``DRAIN_MARGIN_S`` is left over for
    the agent's own exit.
    """
    budget = max(max(kill_wait_s, SLURM_MIN_KILL_WAIT_S) - DRAIN_MARGIN_S, 0.0)
    want = {role: _requested_grace(recipe, role) for role in PROCESSES}
    decode = min(want["decode"], budget)
    head = want["prefill"] + want["router"]
    scale = budget / head if head > budget else 1.0
    return {
        "prefill": round(want["prefill"] * scale, 3),
        "decode": round(decode, 3),
        "router": round(want["router"] * scale, 3),
    }


def _model_argument(recipe: Recipe) -> str:
    path = recipe.model.path
    if not path:
        # The rules refuse this at load; a plan without a model cannot be written.
        raise InputError([error("model.path", "no model to serve", "set model.path")])
    # The loader already strips hf:; a plan built from an unresolved recipe must not pass it on.
    return path[len(HF_PREFIX) :] if path.startswith(HF_PREFIX) else path


def _role(recipe: Recipe, name: vocab.Role) -> Role:
    role: Role | None = getattr(recipe.roles, name)
    if role is None:
        raise InputError([error(f"roles.{name}", f"the {name} role is missing", "add it")])
    return role


def _role_plan(
    recipe: Recipe,
    name: vocab.Role,
    *,
    program: list[str],
    first_node: int,
    grace: float,
) -> RolePlan:
    role = _role(recipe, name)
    nodes, workers, gpus = role_layout(role, gpus_per_node(recipe))
    env, secret = split_env(role_env(recipe, role))
    bases = getattr(recipe.agent.ports, name)
    port_base = {"http": bases.http, "agent": bases.agent}
    if bases.ctrl is not None:
        port_base["ctrl"] = bases.ctrl
    return RolePlan(
        role=name,
        nodes=nodes,
        workers=workers,
        gpus_per_worker=gpus,
        first_node=first_node,
        image=role.container or recipe.model.container,
        program=program,
        args=render_args(role.args),
        env=env,
        secret_env=secret,
        port_base=port_base,
        startup_budget_s=_startup_budget(recipe, name),
        stop_grace_s=grace,
    )


def _mounts(recipe: Recipe) -> list[str]:
    mounts = recipe.container_mounts
    if isinstance(mounts, dict):
        return [f"{host}:{container}" for host, container in mounts.items()]
    return list(mounts)


def choose_launcher(
    cluster: ClusterConfig | None, *, mock: bool, launcher: str | None
) -> LauncherName:
    """Any stand-in forces ``process``; else the explicit launcher, the cluster's, or ``process``.

    Stand-ins run with the agent's own interpreter, which no engine image has.
    """
    if mock:
        return "process"
    chosen = launcher or (cluster.launcher if cluster is not None else "process")
    for known in LAUNCHERS:
        if chosen == known:
            return known
    raise ValueError(f"unknown launcher {chosen!r}")


def _cpu_only_cluster(loaded: LoadedRecipe, standins: Collection[Process]) -> None:
    """On a CPU-only cluster (gpus_per_node: 0) a real engine must say ``gpus: 0`` itself."""
    if gpus_per_node(loaded.recipe) != 0:
        return
    problems = [
        error(
            f"roles.{name}.gpus",
            f"the cluster has no GPUs (gpus_per_node: 0) and the {name} engine is real with no "
            "GPU count of its own",
            f"set roles.{name}.gpus: 0 to run it on CPUs, or run it as a stand-in "
            f"(--mock {name}), or set resources.gpus_per_node (cluster file gpus_per_node)",
        )
        for name in loaded.gpus_unset
        if name not in standins
    ]
    if problems:
        raise InputError(problems)


def make_plan(
    loaded: LoadedRecipe,
    *,
    mock: bool | Collection[Process] = False,
    launcher: str | None = None,
) -> Plan:
    """The launch plan of a loaded (validated, resolved) recipe.

    ``mock``: True replaces every engine by its stand-in (``--mock``), a collection only those
    named (``--mock decode``).
    """
    named = set(PROCESSES) if mock is True else set(mock or ())
    standins = [name for name in PROCESSES if name in named]
    recipe = loaded.recipe
    _cpu_only_cluster(loaded, standins)
    # No cluster file: the site defaults every field of ClusterConfig states (one source).
    cluster = loaded.cluster or ClusterConfig()
    graces = stop_graces(recipe, cluster.kill_wait_s)
    prefill = _role_plan(
        recipe,
        "prefill",
        program=[*recipe.agent.prefill_command, _model_argument(recipe)],
        first_node=0,
        grace=graces["prefill"],
    )
    decode = _decode_plan(recipe, first_node=prefill.nodes, grace=graces["decode"])
    router = _router_plan(recipe, grace=graces["router"])
    return Plan(
        name=recipe.name or "",
        model=public_model_name(recipe) or _model_argument(recipe),
        standins=standins,
        launcher=choose_launcher(loaded.cluster, mock=bool(standins), launcher=launcher),
        network_interface=cluster.network_interface,
        visible_devices_env=cluster.visible_devices_env,
        mounts=_mounts(recipe),
        setup_script=recipe.setup_script,
        configs_dir=cluster.configs_dir,
        prefill=prefill,
        decode=decode,
        router=router,
        agent=_agent_plan(recipe.agent),
        slurm=_slurm_plan(recipe, cluster, prefill, decode),
        convert=convert_plan(recipe),
        benchmark=_benchmark(recipe, stop_grace_s=router.stop_grace_s),
        frameworks=dict(recipe.agent.frameworks) if recipe.agent.frameworks else msgspec.UNSET,
        pyxis_flags=list(recipe.agent.pyxis_flags) if recipe.agent.pyxis_flags else msgspec.UNSET,
    )


def _decode_plan(recipe: Recipe, *, first_node: int, grace: float) -> DecodePlan:
    """The decode's role plan, with its model profile and weights folder read from its args."""
    base = _role_plan(
        recipe,
        "decode",
        program=[recipe.agent.decode_python, "-m", DECODE_MODULE],
        first_node=first_node,
        grace=grace,
    )
    args = _role(recipe, "decode").args
    profile = find_arg(args, "model")
    weights = find_arg(args, "model-weights-dir")
    return DecodePlan(
        **msgspec.structs.asdict(base),
        model_profile=_flag_value(profile) or DEFAULT_TILERT_MODEL,
        weights_dir=_flag_value(weights),
    )


def _flag_value(found: tuple[str, ArgValue] | None) -> str | None:
    """A flag's value as its argv word (None when absent, null, false or empty)."""
    if found is None or found[1] is None or found[1] is False:
        return None
    return render_value(found[1]) or None


def _router_plan(recipe: Recipe, *, grace: float) -> RouterPlan:
    agent = recipe.agent
    env, secret = split_env(role_env(recipe, recipe.frontend))
    return RouterPlan(
        image=recipe.frontend.container_image or recipe.model.container,
        program=[agent.router_python, "-m", ROUTER_MODULE],
        args=render_args(recipe.frontend.args),
        env=env,
        secret_env=secret,
        port=agent.router_port,
        python=agent.router_python,
        startup_budget_s=_startup_budget(recipe, "router"),
        stop_grace_s=grace,
    )


def _agent_plan(agent: AgentSection) -> AgentPlan:
    """The recipe's ``agent:`` settings as every agent reads them (``plan.agent``)."""
    return AgentPlan(
        probe_startup_interval_s=agent.probe.startup_interval_s,
        probe_interval_s=agent.probe.interval_s,
        probe_timeout_s=agent.probe.timeout_s,
        probe_failure_threshold=agent.probe.failure_threshold,
        restart_backoff_initial_s=agent.restart.backoff_initial_s,
        restart_backoff_max_s=agent.restart.backoff_max_s,
        restart_max=agent.restart.max_restarts,
        restart_window_s=agent.restart.window_s,
        bind=agent.bind,
        log_max_bytes=agent.logs.max_bytes,
        log_backups=agent.logs.backups,
        canary_prompt=agent.canary.prompt,
        canary_max_tokens=agent.canary.max_tokens,
        canary_timeout_s=agent.canary.timeout_s,
        canary_attempt_timeout_s=canary_attempt_s(agent.canary),
        canary_verify=agent.canary.verify,
        canary_verify_margin=agent.canary.verify_margin,
        scratch_dir=agent.scratch_dir,
        log_node_dir=agent.logs.node_dir if agent.logs.location == "node" else None,
        startup_silence_s=agent.startup_silence_s,
        startup_max_s=agent.startup_max_s,
        preflight=agent.preflight,
        max_rejoins=agent.max_rejoins,
        down_decode_out_after_s=agent.down_decode_out_after_s,
        front=agent.front,
    )


def _slurm_plan(
    recipe: Recipe, cluster: ClusterConfig, prefill: RolePlan, decode: RolePlan
) -> SlurmPlan:
    return SlurmPlan(
        account=recipe.slurm.account,
        partition=recipe.slurm.partition,
        time_limit=recipe.slurm.time_limit,
        nodes=prefill.nodes + decode.nodes,
        # Each node runs one worker: ask for what the largest worker holds (0: no GPU line).
        gpus_per_node=max(prefill.gpus_per_worker, decode.gpus_per_worker),
        signal_lead_s=cluster.signal_lead_s,
        exclusive=cluster.exclusive,
        kill_wait_s=cluster.kill_wait_s,
    )


def _benchmark(recipe: Recipe, *, stop_grace_s: float) -> BenchmarkPlan | msgspec.UnsetType:
    env, secret = split_env({**recipe.environment, **recipe.benchmark.env})
    return benchmark_plan(recipe, env=env, secret_env=secret, stop_grace_s=stop_grace_s)
