"""Command builders: the one place that knows each engine's argv and environment.

The plan carries each role's program and the user's arguments; this module adds what the agent
manages (hosts, ports, ``--engine tilert``, the router's ``--vllm-url`` and its ONE ``--decode``
flag) and the environment (GPU visibility, ``TILERT_PD_PROBE_ADDR``, the agent's name, the
process's scratch folders). For a process the plan names in ``standins`` (``--mock``) the program
is swapped for the project's stand-in and the argument list is kept, so these builders run
exactly as in production.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from agent.job.benchmark import BenchmarkPlan
from agent.job.paths import JOB_DIR_ENV
from agent.job.plan import Plan, RolePlan, RouterPlan
from agent.launch.scratch import SCRATCH_ENV, scratch_env

# The stand-in that replaces each real program under --mock
# (docs/design.md: "Stand-ins are product code").
STANDIN_MODULES = {
    "prefill": "agent.standins.prefill",
    "decode": "agent.standins.decode",
    "router": "agent.standins.router",
    "converter": "agent.standins.converter",
}
GPU_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# Variables the agent itself sets for engines (besides GPU visibility).
MANAGED_ENV = (
    "TILERT_AGENT_NAME",
    "TILERT_PD_PROBE_ADDR",
    JOB_DIR_ENV,
    *GPU_ENV_NAMES,
    *SCRATCH_ENV,
    "HF_HOME",
)


def arg_value(args: list[str], flag: str) -> str | None:
    """The value following ``flag`` in a rendered argument list (``--flag value``)."""
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


@dataclass(frozen=True)
class DecodeEndpoint:
    """One decode node as the router's ``--decode host:ctrl:http`` names it."""

    host: str
    ctrl: int
    http: int

    def spec(self) -> str:
        """``host:ctrl:http``."""
        return f"{self.host}:{self.ctrl}:{self.http}"


@dataclass(frozen=True)
class Command:
    """One process's argv and complete environment, ready for a ``LaunchSpec``."""

    argv: list[str]
    env: dict[str, str]


def _standin(role: str) -> list[str]:
    return [sys.executable, "-m", STANDIN_MODULES[role]]


def _base_env(
    plan: Plan,
    plan_env: Mapping[str, str],
    secret_names: Sequence[str],
    agent_env: Mapping[str, str],
    name: str,
    scratch: str | None,
) -> dict[str, str]:
    # Secrets reach engines from the agent's (submitting) environment, never from a file. Every
    # agent inherits every recipe secret, so one that the recipe gives to another process only
    # (say roles.prefill.env.HF_TOKEN) is taken out again here.
    others = {
        secret
        for owner in (plan.prefill.secret_env, plan.decode.secret_env, plan.router.secret_env)
        for secret in owner
    } - set(secret_names)
    env = {k: v for k, v in agent_env.items() if k not in others}
    env.update(plan_env)
    for secret in secret_names:
        if secret in agent_env:
            env[secret] = agent_env[secret]
    env["TILERT_AGENT_NAME"] = name
    if scratch is not None:
        env.update(scratch_env(scratch, plan_env, agent_env))
    return env


def _gpu_env(env: dict[str, str], plan: Plan, role: RolePlan, agent_env: Mapping[str, str]) -> None:
    var = plan.visible_devices_env
    if var in agent_env and agent_env[var] != "":
        return  # Slurm (gres) already chose this step's GPUs; keep its choice.
    env[var] = ",".join(str(i) for i in range(role.gpus_per_worker))


def prefill_command(
    plan: Plan,
    *,
    name: str,
    host: str,
    http_port: int,
    scratch: str | None = None,
    agent_env: Mapping[str, str] = os.environ,
) -> Command:
    """``vllm serve MODEL <role args> --host H --port P`` (``agent.prefill_command`` + MODEL)."""
    role = plan.prefill
    # The stand-in takes `serve MODEL` whatever command starts the real vLLM.
    model = role.program[-1:]
    program = [*_standin("prefill"), "serve", *model] if plan.standin("prefill") else role.program
    argv = [*program, *role.args, "--host", host, "--port", str(http_port)]
    env = _base_env(plan, role.env, role.secret_env, agent_env, name, scratch)
    _gpu_env(env, plan, role, agent_env)
    return Command(argv, env)


def decode_command(
    plan: Plan,
    *,
    name: str,
    address: str,
    http_port: int,
    ctrl_port: int,
    scratch: str | None = None,
    agent_env: Mapping[str, str] = os.environ,
) -> Command:
    """``python -m tilert.pd_vllm.decode_server --engine tilert --http-port H --ctrl-port C ...``"""
    role = plan.decode
    program = _standin("decode") if plan.standin("decode") else list(role.program)
    # --engine defaults to a stub in TileRT 0.1.6: a real deployment must always say tilert.
    argv = [
        *program,
        "--engine",
        "tilert",
        "--http-port",
        str(http_port),
        "--ctrl-port",
        str(ctrl_port),
        *role.args,
    ]
    env = _base_env(plan, role.env, role.secret_env, agent_env, name, scratch)
    # TileRT finds its own IP with a UDP "connect" to this address (default 8.8.8.8, which fails
    # on nodes without a default route).
    env["TILERT_PD_PROBE_ADDR"] = address
    _gpu_env(env, plan, role, agent_env)
    return Command(argv, env)


def engine_command(
    plan: Plan,
    role: str,
    *,
    name: str,
    address: str,
    ports: Mapping[str, int],
    scratch: str | None = None,
) -> Command:
    """The engine of ``role`` on a node at ``address`` with its chosen ``ports``."""
    if role == "prefill":
        return prefill_command(
            plan, name=name, host=address, http_port=ports["http"], scratch=scratch
        )
    return decode_command(
        plan,
        name=name,
        address=address,
        http_port=ports["http"],
        ctrl_port=ports["ctrl"],
        scratch=scratch,
    )


def router_command(
    plan: Plan,
    *,
    prefill_url: str,
    decodes: Sequence[DecodeEndpoint],
    host: str,
    use_standin: bool,
    scratch: str | None = None,
    agent_env: Mapping[str, str] = os.environ,
) -> Command:
    """``<router_python> -m tilert.pd_vllm.pd_router --vllm-url U --decode h:c:p ... --port P``."""
    router: RouterPlan = plan.router
    program = _standin("router") if use_standin else list(router.program)
    # ONE --decode flag with every node: the router's argparse keeps only the last repeated flag.
    argv = [
        *program,
        "--vllm-url",
        prefill_url,
        "--decode",
        *(d.spec() for d in decodes),
        "--host",
        host,
        "--port",
        str(router.port),
        *router.args,
    ]
    env = _base_env(plan, router.env, router.secret_env, agent_env, "router", scratch)
    for var in GPU_ENV_NAMES:
        env[var] = ""  # the router needs no GPU and must not grab one
    return Command(argv, env)


def benchmark_env(
    plan: Plan,
    bench: BenchmarkPlan,
    *,
    scratch: str | None = None,
    agent_env: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The benchmark client's environment: recipe ``environment`` + ``benchmark.env``, its
    scratch folder (the head's client; ``tilert-submit bench`` has none), no GPU."""
    env = _base_env(plan, bench.env, bench.secret_env, agent_env, "benchmark", scratch)
    for var in GPU_ENV_NAMES:
        env[var] = ""  # the client needs no GPU and must not grab the engines'
    # Its progress lines reach the log as they are printed.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def convert_command(
    plan: Plan,
    *,
    name: str,
    save_dir: str,
    append_mtp: bool,
    agent_env: Mapping[str, str] = os.environ,
) -> Command:
    """``python -m tilert.models.preprocess.weight_converter --model_type T --model_dir SRC
    --save_dir OUT [--append_mtp]`` with the decode's environment."""
    convert = plan.convert
    if isinstance(convert, msgspec.UnsetType):
        raise ValueError("the plan has no conversion (roles.decode.convert)")
    program = _standin("converter") if plan.standin("decode") else list(convert.program)
    argv = [
        *program,
        "--model_type",
        convert.model_type,
        "--model_dir",
        convert.source,
        "--save_dir",
        save_dir,
    ]
    if append_mtp:
        argv.append("--append_mtp")
    env = _base_env(plan, plan.decode.env, plan.decode.secret_env, agent_env, name, None)
    # Its progress lines reach convert.log as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return Command(argv, env)
