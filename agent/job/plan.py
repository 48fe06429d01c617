"""The launch plan (``J/plan.json``): what every agent needs to start its engine, and nothing
secret.

The submitter's planner (``agent.recipe.planner``) writes it; every agent reads it. Commands are
kept as ``program`` + ``args`` *without* the arguments the agent manages (hosts, ports,
``--engine``, ``--vllm-url``, ``--decode``): the agent adds those once it has chosen its ports
(``agent.launch.commands``). For each process named in ``standins`` (``tilert-submit --mock
[ROLES]``) the agent swaps the program for the project's stand-in and keeps the argument list, so
the command builders are exercised exactly as in production.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from agent.job.benchmark import BenchmarkPlan
from agent.job.frontpolicy import FrontPolicy
from agent.job.preflightpolicy import PreflightPolicy
from agent.job.vocab import PROCESSES, Process, Role

PLAN_SCHEMA = 1
# What an agent may take to exit beyond its engines' graces (sweep leftovers, write its last
# status, close its logs). Generous: whoever waits stops waiting as soon as the agents are gone.
AGENT_EXIT_SLACK_S = 10.0

# The conversion's budgets when the recipe sets none (recipe ``agent.convert_budget_s`` and
# ``agent.convert_lock_stale_s``): one home, read by the recipe defaults and by an agent whose plan
# has no conversion but that finds someone else's conversion in progress.
DEFAULT_CONVERT_BUDGET_S = 4 * 3600.0
DEFAULT_CONVERT_LOCK_STALE_S = 120.0

LauncherName = Literal["process", "pyxis"]
LAUNCHERS: tuple[LauncherName, ...] = get_args(LauncherName)


def parse_standins(spec: str) -> list[Process]:
    """``--mock``'s ROLES (``decode``, ``prefill,router``, ``all``) in canonical order.

    ValueError names what is not a role.
    """
    names = {part.strip() for part in spec.split(",") if part.strip()}
    if "all" in names:
        names = (names - {"all"}) | set(PROCESSES)
    unknown = sorted(names - set(PROCESSES))
    if unknown or not names:
        raise ValueError(
            f"{', '.join(unknown) or spec!r} is not a role; name one or more of "
            f"{', '.join(PROCESSES)} separated by commas, or all"
        )
    return [name for name in PROCESSES if name in names]


class RolePlan(msgspec.Struct, kw_only=True):
    role: Role
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


class DecodePlan(RolePlan, kw_only=True):
    """The decode's plan: a role's, and what two of its flags mean to the agent (read once, by
    the planner, so that nothing parses ``args`` back)."""

    # TileRT's model profile (``--model``; agent.facts.DEFAULT_TILERT_MODEL when left out).
    model_profile: str
    # The weights folder the engine loads (``--model-weights-dir``, as the engine sees it); None
    # when the recipe names none. The weights gate checks (or converts) it before the engine.
    weights_dir: str | None


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


# How often the head takes a dropped decode back, unless the recipe says (agent.max_rejoins).
DEFAULT_MAX_REJOINS = 3
# How long a decode in the router's list may be down before the head takes it out of the list
# (agent.down_decode_out_after_s; docs/performance.md, "A decode that is down").
DEFAULT_DOWN_DECODE_OUT_AFTER_S = 2.0


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
    canary_attempt_timeout_s: float
    # agent.scratch_dir: None (per-job folder under the node's temp folder), "job", or a path.
    scratch_dir: str | None
    # agent.logs.location: node -> the node-local folder (None: engine logs in J/logs). Last and
    # omitted when None, so plans of jobs with logs in the job directory read as before.
    log_node_dir: str | None = None
    # agent.startup_silence_s / startup_max_s: startup deadlines that watch progress.
    startup_silence_s: float = 900.0
    startup_max_s: float = 14400.0
    # agent.canary.verify / verify_margin: each decode's answers checked (agent.head.verify).
    canary_verify: bool = True
    canary_verify_margin: float = 1.0
    # agent.preflight: the node checks' policy (omitted when every value is the default).
    preflight: PreflightPolicy = msgspec.field(default_factory=PreflightPolicy)
    # agent.max_rejoins: how often a dropped decode healthy again is taken back (the head's).
    max_rejoins: int = DEFAULT_MAX_REJOINS
    # agent.down_decode_out_after_s: a decode down this long leaves the router's list (the
    # head's); None: never (the front's retries wait for it).
    down_decode_out_after_s: float | None = DEFAULT_DOWN_DECODE_OUT_AFTER_S
    # agent.front: the front door's port, retries and bounds (omitted when all are the defaults).
    front: FrontPolicy = msgspec.field(default_factory=FrontPolicy)


class ConvertPlan(msgspec.Struct, kw_only=True):
    """``roles.decode.convert`` resolved: how an incomplete decode weights folder is made.

    The folder itself is the decode's ``--model-weights-dir`` (``DecodePlan.weights_dir``).
    """

    # The Hugging Face checkpoint the converter reads (as the converter sees it).
    source: str
    # The converter's --model_type (from the decode model profile when the recipe leaves it out).
    model_type: str
    # Add the MTP layer to an existing conversion instead of converting from scratch.
    append_mtp: bool
    # ``[python, "-m", CONVERTER_MODULE]``; under --mock the agent runs the stand-in instead.
    program: list[str]
    budget_s: float
    lock_stale_s: float
    # A ``tilert-submit convert`` job: convert, then end (no engine, no prefill).
    only: bool = False


class Plan(msgspec.Struct, kw_only=True):
    schema: int = PLAN_SCHEMA
    name: str
    # The public model name clients send (the prefill's served-model-name, else the model path).
    model: str
    # The processes the project's stand-ins replace (``--mock``: all three); [] in production.
    standins: list[Process] = []
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
    decode: DecodePlan
    router: RouterPlan
    agent: AgentPlan
    slurm: SlurmPlan
    # Absent (not even null) without roles.decode.convert, so plans without one read as before.
    convert: ConvertPlan | msgspec.UnsetType = msgspec.UNSET
    # Absent for ``benchmark.type: manual`` (docs/benchmark.md), so those plans read as before.
    benchmark: BenchmarkPlan | msgspec.UnsetType = msgspec.UNSET
    # The recipe's version pins (agent.frameworks; schema 1's identity.frameworks): package ->
    # version, checked in each engine's preflight. Absent without pins.
    frameworks: dict[str, str] | msgspec.UnsetType = msgspec.UNSET
    # Flags added to every pyxis step (agent.pyxis_flags; schema 1's srun_options). Absent
    # without.
    pyxis_flags: list[str] | msgspec.UnsetType = msgspec.UNSET

    def standin(self, name: Process) -> bool:
        """Whether ``name``'s process is the project's stand-in (the router's: where needed)."""
        return name in self.standins

    def role(self, name: Role) -> RolePlan:
        """The plan of one role by name."""
        return self.prefill if name == "prefill" else self.decode

    def drain_s(self) -> float:
        """How long a whole job may take to drain: the router, then the slower worker, plus slack.

        The head stops the router before its own engine (requests in flight still reference the
        prefill) and every decode agent drains at the same time, so this bounds every agent's exit.
        Whoever stops a job (``tilert-submit stop``, the ``--local`` supervisor) waits this long
        before it kills.
        """
        workers = max(self.prefill.stop_grace_s, self.decode.stop_grace_s)
        return self.router.stop_grace_s + workers + AGENT_EXIT_SLACK_S


def load_plan(data: bytes) -> Plan:
    """Decode ``plan.json`` bytes, checking the schema version."""
    plan = msgspec.json.decode(data, type=Plan)
    if plan.schema != PLAN_SCHEMA:
        raise ValueError(f"plan.json has schema {plan.schema}; this agent reads {PLAN_SCHEMA}")
    return plan
