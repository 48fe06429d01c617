"""The readable plan ``tilert-submit --dry-run`` prints: who runs where, with what, for how long.

Command lines come from the agent's own builders (``agent.launch.commands``) with the values the
agent chooses on its node shown as placeholders, so what is printed is what will run.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from agent.job.names import HEAD_NAME, ROUTER_NAME, agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan, RolePlan
from agent.job.secrets import MASK
from agent.launch.commands import (
    DecodeEndpoint,
    convert_command,
    decode_command,
    prefill_command,
    router_command,
)
from agent.recipe.model import agent_keys

CHOSEN = "<agent>"


class _Chosen(int):
    """A port the agent chooses on its node: prints as the placeholder."""

    def __str__(self) -> str:
        return CHOSEN


@dataclass(frozen=True)
class _ChosenDecode(DecodeEndpoint):
    """A decode node as the router's ``--decode`` will name it, once its agent has chosen."""

    name: str = ""

    def spec(self) -> str:
        """``<decode-N host:ctrl:http>``."""
        return f"<{self.name} host:ctrl:http>"


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _names(role: RolePlan) -> list[str]:
    return [agent_name(role.role, i) for i in range(role.nodes)]


def _env_lines(env: dict[str, str], secret: list[str]) -> list[str]:
    lines = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [f"{k}={MASK} (from the submitting environment)" for k in secret]
    return lines or ["(none)"]


def _node_map(plan: Plan) -> list[str]:
    rows = []
    for role in (plan.prefill, plan.decode):
        what = "vLLM prefill" if role.role == "prefill" else "TileRT decode"
        for i, name in enumerate(_names(role)):
            extra = f" + router (port {plan.router.port})" if name == HEAD_NAME else ""
            gpus = f"{role.gpus_per_worker} GPU{'s' if role.gpus_per_worker != 1 else ''}"
            rows.append(f"  node {role.first_node + i:<3} {name:<10} {what} ({gpus}){extra}")
    return rows


def _commands(plan: Plan) -> list[str]:
    chosen = _Chosen()
    prefill = prefill_command(plan, name="prefill-0", host=CHOSEN, http_port=chosen, agent_env={})
    decode = decode_command(
        plan, name="decode-N", address=CHOSEN, http_port=chosen, ctrl_port=chosen, agent_env={}
    )
    decodes = [_ChosenDecode(host="", ctrl=0, http=0, name=name) for name in _names(plan.decode)]
    router = router_command(
        plan,
        prefill_url="<prefill-0 url>",
        decodes=decodes,
        host=CHOSEN,
        use_standin=False,
        agent_env={},
    )
    decode_names = _names(plan.decode)
    decode_label = (
        decode_names[0]
        if len(decode_names) == 1
        else (f"{decode_names[0]} .. {decode_names[-1]} (each)")
    )
    lines = [
        f"  {HEAD_NAME}:",
        f"    {shlex.join(prefill.argv)}",
        f"  {decode_label}:",
        f"    {shlex.join(decode.argv)}",
        f"  {ROUTER_NAME} (in {HEAD_NAME}, after every worker is healthy):",
        f"    {shlex.join(router.argv)}",
    ]
    if plan.standin("router"):
        lines.append(
            f"  (--mock: the router is TileRT's real one when {plan.router.python} can import "
            "tilert.pd_vllm.pd_router, else its stand-in)"
        )
    return lines


def _standins(plan: Plan) -> str:
    """Which processes are the project's stand-ins (``plan.standins``)."""
    if not plan.standins:
        return "none (every process is the real engine)"
    shown = [
        f"{name} (where {plan.router.python} cannot import the real one)"
        if name == "router"
        else name
        for name in plan.standins
    ]
    return ", ".join(shown) + " (--mock)"


def _programs(plan: Plan) -> str:
    """The programs the agent starts (agent.prefill_command, decode_python, router_python)."""
    # The prefill program is the command with the model path appended.
    return (
        f"prefill {shlex.join(plan.prefill.program[:-1])} (agent.prefill_command), "
        f"decode {plan.decode.program[0]} (agent.decode_python), "
        f"router {plan.router.python} (agent.router_python)"
    )


def _scratch(plan: Plan) -> str:
    where = plan.agent.scratch_dir
    if where is None:
        return "a folder per agent under the node's temp folder (agent.scratch_dir)"
    if where == "job":
        return "a folder per agent under the job directory (agent.scratch_dir: job)"
    return f"a folder per agent under {where} (agent.scratch_dir)"


def _ports(role: RolePlan) -> str:
    return ", ".join(f"{kind} from {port}" for kind, port in role.port_base.items())


def _slurm_header(plan: Plan) -> list[str]:
    """The sbatch header in words."""
    slurm = plan.slurm
    header = [
        f"{slurm.nodes} node{'s' if slurm.nodes != 1 else ''}",
        "1 task per node",
        f"{slurm.gpus_per_node} GPUs per node" if slurm.gpus_per_node else "no GPUs",
    ]
    if slurm.exclusive:
        header.append("exclusive")
    for label, value in (
        ("account", slurm.account),
        ("partition", slurm.partition),
        ("time", slurm.time_limit),
    ):
        if value:
            header.append(f"{label} {value}")
    header.append(f"SIGTERM {slurm.signal_lead_s} s before the time limit")
    return header


def _weights_lines(plan: Plan) -> list[str]:
    """What the decode agents check before their engines, and how they convert (if they do)."""
    folder = plan.decode.weights_dir
    if not folder:
        return []
    lines = [
        "Weights (checked on each decode node before its engine starts; docs/weights.md):",
        f"  folder   {folder} (roles.decode.args.model-weights-dir)",
    ]
    convert = plan.convert
    if isinstance(convert, msgspec.UnsetType):
        return [*lines, "  convert  no: an incomplete folder fails the decode at once"]
    command = convert_command(plan, name="decode-N", save_dir="<hidden sibling>", append_mtp=False)
    return [
        *lines,
        f"  convert  from {convert.source}, once, under a lock, when the folder is incomplete"
        + ("; --append_mtp onto an existing conversion" if convert.append_mtp else ""),
        f"    {shlex.join(command.argv)}",
        f"  budget   {_seconds(convert.budget_s)} (agent.convert_budget_s); a lock not refreshed "
        f"for {_seconds(convert.lock_stale_s)} is taken over (agent.convert_lock_stale_s)",
    ]


def render_convert_plan(
    plan: Plan, job: JobDir, agent_command: list[str], *, local: bool = False
) -> str:
    """The dry-run printout of a convert job (``tilert-submit convert RECIPE --dry-run``)."""
    launcher = plan.launcher + (
        " (--mock: the converter is the project's stand-in)" if plan.standin("decode") else ""
    )
    lines = [
        f"Convert job {plan.name}: the decode weights of model {plan.model!r}",
        f"  launcher:    {launcher}",
        f"  slurm:       {'not used (--local)' if local else ', '.join(_slurm_header(plan))}",
        f"  agent:       {'a local process (--local)' if local else shlex.join(agent_command)}"
        f" as {agent_name('decode', 0)}",
        f"  image:       {plan.decode.image or '(none)'}"
        + ("  (not used by the process launcher)" if plan.launcher == "process" else ""),
        "",
        *_weights_lines(plan),
        "",
        "Files:",
        f"  {job.recipe}",
        f"  {job.plan}",
        f"  {job.sbatch}",
        f"  {job.status}",
    ]
    return "\n".join(lines)


def render_plan(plan: Plan, job: JobDir, agent_command: list[str], *, local: bool = False) -> str:
    """The dry-run printout of ``plan`` (secrets masked; nothing here is submitted)."""
    slurm = plan.slurm
    header = _slurm_header(plan)
    images = [
        ("prefill", plan.prefill.image),
        ("decode", plan.decode.image),
        (ROUTER_NAME, plan.router.image),
    ]
    launcher = plan.launcher + (" (forced by --mock)" if plan.standins else "")
    lines = [
        f"Plan for {plan.name}: model {plan.model!r}",
        f"  launcher:    {launcher}",
        f"  stand-ins:   {_standins(plan)}",
        f"  programs:    {_programs(plan)}",
        f"  scratch:     {_scratch(plan)}",
        f"  network:     {plan.network_interface or 'the address of each node name'}",
        f"  GPU env:     {plan.visible_devices_env}",
        f"  slurm:       {'not used (--local)' if local else ', '.join(header)}",
        f"  agent:       {'local processes (--local)' if local else shlex.join(agent_command)}",
        "",
        "Nodes (Slurm node offsets in the allocation; one agent per node):"
        if not local
        else "Agents (all on this machine, as if on these node offsets):",
        *_node_map(plan),
        "",
        f"Commands ({CHOSEN}: chosen by the agent on its node):",
        *_commands(plan),
        "",
        "Images:" + ("  (not used by the process launcher)" if plan.launcher == "process" else ""),
        *(f"  {name:<8} {image or '(none)'}" for name, image in images),
        "Mounts:",
        *([f"  {m}" for m in plan.mounts] or ["  (none)"]),
    ]
    if plan.setup_script:
        lines.append(f"Setup script: {plan.configs_dir}/{plan.setup_script}")
    lines.append("Environment (secrets masked):")
    for label, env, secret in (
        ("prefill", plan.prefill.env, plan.prefill.secret_env),
        ("decode", plan.decode.env, plan.decode.secret_env),
        (ROUTER_NAME, plan.router.env, plan.router.secret_env),
    ):
        lines.append(f"  {label}:")
        lines += [f"    {line}" for line in _env_lines(env, secret)]
    lines += [
        "Ports (probed on each node from these bases):",
        f"  prefill  {_ports(plan.prefill)}",
        f"  decode   {_ports(plan.decode)}",
        f"  router   {plan.router.port} (fixed: agent.router_port)",
        "Budgets:",
        f"  startup  prefill {_seconds(plan.prefill.startup_budget_s)}, decode "
        f"{_seconds(plan.decode.startup_budget_s)}, "
        f"router {_seconds(plan.router.startup_budget_s)}",
        f"  stop     prefill {_seconds(plan.prefill.stop_grace_s)}, decode "
        f"{_seconds(plan.decode.stop_grace_s)}, router {_seconds(plan.router.stop_grace_s)} "
        f"(fit in KillWait {_seconds(slurm.kill_wait_s)})",
        *_weights_lines(plan),
        *_benchmark_lines(plan),
        *policy_lines(plan),
        "Files:",
        f"  {job.recipe}",
        f"  {job.plan}",
        f"  {job.sbatch}",
        f"  {job.status}",
    ]
    return "\n".join(lines)


def _benchmark_lines(plan: Plan) -> list[str]:
    """What runs once the job is ready (docs/benchmark.md); nothing for ``manual``."""
    bench = plan.benchmark
    if isinstance(bench, msgspec.UnsetType):
        return []
    after = "keeps serving" if bench.keep_serving else "ends (keep_serving false)"
    lines = ["Benchmark (once ready; results in J/benchmark/, log J/logs/benchmark/):"]
    if bench.type == "custom":
        lines.append(f"  custom   bash -c {shlex.quote(bench.command or '')}")
    else:
        per_level = (
            f"{bench.num_requests} requests"
            if bench.num_requests is not None
            else f"{_seconds(bench.duration_s)}"
            if bench.duration_s is not None
            else "10 requests per concurrent user"
        )
        lines += [
            f"  aiperf   {shlex.join(bench.program)}: concurrencies "
            f"{', '.join(map(str, bench.concurrencies))}; isl {bench.isl}, osl {bench.osl}; "
            f"{per_level} per level"
            + (f", {bench.req_rate:g} req/s" if bench.req_rate is not None else "")
            + (f", {bench.warmup_requests} warmup" if bench.warmup_requests else ""),
            f"  tokenizer {bench.tokenizer or '(none)'}; fails on 0 output tokens, more than "
            f"{bench.max_error_rate:g} failed, or a client exit status",
        ]
    lines.append(
        f"  client on the {'head' if bench.placement == 'head' else 'last decode'} node"
        + (f", image {bench.image}" if bench.image else "")
        + f"; then the job {after}"
    )
    return lines


def _unset_or(value: object, shown: Callable[[Any], str]) -> str:
    return "(none)" if value is None or isinstance(value, msgspec.UnsetType) else shown(value)


def _convert(plan: Plan, budget: bool) -> str:
    convert = plan.convert
    if isinstance(convert, msgspec.UnsetType):
        return "(not used: no roles.decode.convert)"
    return _seconds(convert.budget_s if budget else convert.lock_stale_s)


def _port(role: RolePlan, kind: str) -> str:
    port = role.port_base.get(kind)
    return "(none)" if port is None else f"{port} and up"


# Every ``agent:`` key as the plan resolved it; tests/test_submit_cli.py fails when a key of the
# recipe model (agent.recipe.model.agent_keys) has no line here.
_AGENT_VALUES: dict[str, Callable[[Plan], str]] = {
    "agent.router_port": lambda p: str(p.router.port),
    "agent.router_python": lambda p: p.router.python,
    "agent.prefill_command": lambda p: shlex.join(p.prefill.program[:-1]),
    "agent.decode_python": lambda p: p.decode.program[0],
    "agent.scratch_dir": lambda p: p.agent.scratch_dir or "(the node's temp folder)",
    "agent.bind": lambda p: p.agent.bind or "(the node's address)",
    "agent.ports.prefill.http": lambda p: _port(p.prefill, "http"),
    "agent.ports.prefill.agent": lambda p: _port(p.prefill, "agent"),
    "agent.ports.prefill.ctrl": lambda p: _port(p.prefill, "ctrl"),
    "agent.ports.decode.http": lambda p: _port(p.decode, "http"),
    "agent.ports.decode.agent": lambda p: _port(p.decode, "agent"),
    "agent.ports.decode.ctrl": lambda p: _port(p.decode, "ctrl"),
    "agent.probe.startup_interval_s": lambda p: _seconds(p.agent.probe_startup_interval_s),
    "agent.probe.interval_s": lambda p: _seconds(p.agent.probe_interval_s),
    "agent.probe.timeout_s": lambda p: _seconds(p.agent.probe_timeout_s),
    "agent.probe.failure_threshold": lambda p: str(p.agent.probe_failure_threshold),
    "agent.restart.backoff_initial_s": lambda p: _seconds(p.agent.restart_backoff_initial_s),
    "agent.restart.backoff_max_s": lambda p: _seconds(p.agent.restart_backoff_max_s),
    "agent.restart.max_restarts": lambda p: str(p.agent.restart_max),
    "agent.restart.window_s": lambda p: _seconds(p.agent.restart_window_s),
    "agent.startup_budget_s.prefill": lambda p: _seconds(p.prefill.startup_budget_s),
    "agent.startup_budget_s.decode": lambda p: _seconds(p.decode.startup_budget_s),
    "agent.startup_budget_s.router": lambda p: _seconds(p.router.startup_budget_s),
    "agent.startup_silence_s": lambda p: _seconds(p.agent.startup_silence_s),
    "agent.startup_max_s": lambda p: _seconds(p.agent.startup_max_s),
    "agent.stop_grace_s.prefill": lambda p: _seconds(p.prefill.stop_grace_s),
    "agent.stop_grace_s.decode": lambda p: _seconds(p.decode.stop_grace_s),
    "agent.stop_grace_s.router": lambda p: _seconds(p.router.stop_grace_s),
    "agent.canary.prompt": lambda p: repr(p.agent.canary_prompt),
    "agent.canary.max_tokens": lambda p: str(p.agent.canary_max_tokens),
    "agent.canary.timeout_s": lambda p: _seconds(p.agent.canary_timeout_s),
    "agent.canary.attempt_timeout_s": lambda p: _seconds(p.agent.canary_attempt_timeout_s),
    "agent.canary.verify": lambda p: "on" if p.agent.canary_verify else "off",
    "agent.canary.verify_margin": lambda p: f"{p.agent.canary_verify_margin:g} nats/token",
    "agent.max_rejoins": lambda p: str(p.agent.max_rejoins),
    "agent.down_decode_out_after_s": lambda p: (
        "never (null)"
        if p.agent.down_decode_out_after_s is None
        else _seconds(p.agent.down_decode_out_after_s)
    ),
    "agent.front.port": lambda p: f"{p.agent.front.port} and up",
    "agent.front.retry.attempts": lambda p: str(p.agent.front.retry.attempts),
    "agent.front.retry.budget_s": lambda p: _seconds(p.agent.front.retry.budget_s),
    "agent.front.queue.max_waiting": lambda p: str(p.agent.front.queue.max_waiting),
    "agent.front.queue.max_wait_s": lambda p: _seconds(p.agent.front.queue.max_wait_s),
    "agent.front.max_body_bytes": lambda p: str(p.agent.front.max_body_bytes),
    "agent.front.body_timeout_s": lambda p: _seconds(p.agent.front.body_timeout_s),
    "agent.front.resume": lambda p: "on" if p.agent.front.resume else "off",
    "agent.logs.max_bytes": lambda p: str(p.agent.log_max_bytes),
    "agent.logs.backups": lambda p: str(p.agent.log_backups),
    "agent.logs.location": lambda p: "job" if p.agent.log_node_dir is None else "node",
    "agent.logs.node_dir": lambda p: p.agent.log_node_dir or "(not used: logs in the job)",
    "agent.convert_budget_s": lambda p: _convert(p, budget=True),
    "agent.convert_lock_stale_s": lambda p: _convert(p, budget=False),
    "agent.frameworks": lambda p: _unset_or(
        p.frameworks, lambda pins: ", ".join(f"{k} {v}" for k, v in pins.items())
    ),
    "agent.pyxis_flags": lambda p: _unset_or(p.pyxis_flags, shlex.join),
    "agent.preflight.engine_flags": lambda p: p.agent.preflight.engine_flags,
    "agent.preflight.flag_cache_dir": lambda p: (
        p.agent.preflight.flag_cache_dir
        or "(default: $TILERT_FLAG_CACHE, else the user's cache folder)"
    ),
    "agent.preflight.flag_timeout_s": lambda p: _seconds(p.agent.preflight.flag_timeout_s),
    "agent.preflight.stale_processes": lambda p: p.agent.preflight.stale_processes,
    "agent.preflight.gpu_processes": lambda p: p.agent.preflight.gpu_processes,
    "agent.preflight.min_free_gpu_memory": lambda p: f"{p.agent.preflight.min_free_gpu_memory:g}",
    "agent.preflight.stale_shm": lambda p: p.agent.preflight.stale_shm,
    "agent.preflight.shm_dir": lambda p: p.agent.preflight.shm_dir,
    "agent.preflight.disk": lambda p: p.agent.preflight.disk,
    "agent.preflight.min_free_disk_gib": lambda p: f"{p.agent.preflight.min_free_disk_gib:g}",
}


def policy_lines(plan: Plan) -> list[str]:
    """Every ``agent:`` key of the recipe model with its value in ``plan`` (docs/agent.md)."""
    keys = agent_keys()
    width = max(map(len, keys))
    lines = ["Agent settings (every agent: key, as the agents will use it; docs/recipe.md):"]
    for key in keys:
        shown = _AGENT_VALUES.get(key)
        lines.append(f"  {key:<{width}}  {shown(plan) if shown else '(not shown by --dry-run)'}")
    return lines
