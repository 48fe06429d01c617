"""The launch plan (``J/plan.json``): what every agent needs to start its engine, and nothing secret.

The submitter's planner (``agent.planner``) writes it; every agent reads it. Commands are kept as
``program`` + ``args`` *without* the arguments the agent manages (hosts, ports, ``--engine``,
``--vllm-url``, ``--decode``): the agent adds those once it has chosen its ports
(``agent.commands``). With ``mock`` the agent swaps the program for the project's stand-in and keeps
the argument list, so the command builders are exercised exactly as in production.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PLAN_SCHEMA = 1

RoleName = Literal["prefill", "decode"]
LauncherName = Literal["process", "pyxis"]


class RolePlan(msgspec.Struct, kw_only=True):
    role: RoleName
    nodes: int
    workers: int
    gpus_per_worker: int
    # Slurm node offset of the role's first node inside the allocation (srun --relative).
    first_node: int
    image: str | None
    program: list[str]
    args: list[str]
    # Non-secret environment for the engine (recipe ``environment`` + role ``env``), in order.
    env: dict[str, str]
    # Names of secret variables: their values come from the agent's own environment, never a file.
    secret_env: list[str]
    # Where port probing starts: {"http": ..., "agent": ..., "ctrl": ...}.
    port_base: dict[str, int]
    startup_budget_s: float
    stop_grace_s: float


class RouterPlan(msgspec.Struct, kw_only=True):
    image: str | None
    program: list[str]
    args: list[str]
    env: dict[str, str]
    secret_env: list[str]
    port: int
    python: str
    startup_budget_s: float
    stop_grace_s: float


class SlurmPlan(msgspec.Struct, kw_only=True):
    account: str | None
    partition: str | None
    time_limit: str | None
    nodes: int
    gpus_per_node: int
    # sbatch --signal=TERM@lead: agents drain before the time limit.
    signal_lead_s: int
    exclusive: bool
    kill_wait_s: float


class AgentPlan(msgspec.Struct, kw_only=True, omit_defaults=True):
    probe_startup_interval_s: float
    probe_interval_s: float
    probe_timeout_s: float
    probe_failure_threshold: int
    restart_backoff_initial_s: float
    restart_backoff_max_s: float
    restart_max: int
    restart_window_s: float
    bind: str | None
    log_max_bytes: int
    log_backups: int
    canary_prompt: str
    canary_max_tokens: int
    canary_timeout_s: float
    # agent.logs.location: node -> the node-local folder (None: engine logs in J/logs). Last and
    # omitted when None, so plans of jobs with logs in the job directory read as before.
    log_node_dir: str | None = None


class Plan(msgspec.Struct, kw_only=True):
    schema: int = PLAN_SCHEMA
    name: str
    # The public model name clients send (the prefill's served-model-name, else the model path).
    model: str
    mock: bool
    launcher: LauncherName
    # Cluster file's network interface ("lo" means 127.0.0.1); None: the node's resolved address.
    network_interface: str | None
    # Env var that selects GPUs (CUDA_VISIBLE_DEVICES, or ROCR_VISIBLE_DEVICES on AMD clusters).
    visible_devices_env: str
    mounts: list[str]
    setup_script: str | None
    # Where setup scripts are looked up on the node: <configs_dir>/<script>, then .../patches/.
    configs_dir: str = "/configs"
    prefill: RolePlan
    decode: RolePlan
    router: RouterPlan
    agent: AgentPlan
    slurm: SlurmPlan

    def role(self, name: str) -> RolePlan:
        """The plan of one role by name."""
        if name == "prefill":
            return self.prefill
        if name == "decode":
            return self.decode
        raise KeyError(name)


def load_plan(data: bytes) -> Plan:
    """Decode ``plan.json`` bytes, checking the schema version."""
    plan = msgspec.json.decode(data, type=Plan)
    if plan.schema != PLAN_SCHEMA:
        raise ValueError(f"plan.json has schema {plan.schema}; this agent reads {PLAN_SCHEMA}")
    return plan
