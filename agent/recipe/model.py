"""The recipe model: srtctl schema-2 keys for vLLM prefill + TileRT decode, plus ``agent:``.

Field names are the ones users write (srtctl spellings, hyphens kept through ``rename``), so a
msgspec error path or a rule's key path reads like the user's YAML. Everything is optional at the
type level; the rules in ``agent.recipe.rules`` say what is required, so all problems can be
reported together instead of msgspec's first one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from agent.facts import DECODE_PYTHON, PREFILL_PROGRAM, ROUTER_PYTHON
from agent.job.frontpolicy import FrontPolicy
from agent.job.logfiles import DEFAULT_LOG_BACKUPS, DEFAULT_LOG_MAX_BYTES
from agent.job.plan import (
    DEFAULT_CONVERT_BUDGET_S,
    DEFAULT_CONVERT_LOCK_STALE_S,
    DEFAULT_DOWN_DECODE_OUT_AFTER_S,
    DEFAULT_MAX_REJOINS,
)
from agent.job.pool import MAX_DECODES
from agent.job.preflightpolicy import PreflightPolicy

# A scalar or structured value as YAML gives it. Engine args keep their YAML type until rendered.
ArgValue = str | int | float | bool | None | list[Any] | dict[str, Any]
EnvValue = str | int | float | bool

# ---- ranges -------------------------------------------------------------------------------------
# Every number a recipe holds has one of these types. The loader's walker (agent.recipe.typedyaml)
# reports a value outside its range, or a NaN or an infinity, as an error naming the key, so that a
# value that would only fail on the nodes (a negative grace, a NaN budget) is refused before sbatch.
# Upper bounds catch what can only be a mistake (a week-long probe timeout, a billion nodes).
_HOUR_S = 3600.0
_DAY_S = 24 * _HOUR_S
_WEEK_S = 7 * _DAY_S
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# Probe cadences, probe and health-check timeouts, the first restart backoff.
Interval = Annotated[float, msgspec.Meta(gt=0, le=_HOUR_S)]
# SIGTERM-to-SIGKILL graces (capped again to fit Slurm's KillWait).
Grace = Annotated[float, msgspec.Meta(gt=0, le=_HOUR_S)]
# Startup and conversion budgets, restart windows: a model load may take hours, never weeks.
Budget = Annotated[float, msgspec.Meta(gt=0, le=_WEEK_S)]
# A role's nodes and workers: 0 is refused by the rules, with the reason; at most MAX_DECODES, the
# bound of a decode pool (agent.job.pool: the most peers the head has been measured following).
Nodes = Annotated[int, msgspec.Meta(ge=0, le=MAX_DECODES)]
Gpus = Annotated[int, msgspec.Meta(ge=0, le=128)]  # 0: a CPU-only engine (the --mock stand-ins)
GpusPerNode = Annotated[int, msgspec.Meta(ge=0, le=128)]  # 0: a CPU-only cluster
# A benchmark's input or output length.
Tokens = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base for recipe sections: unknown keys are errors (with a "did you mean" from the loader)."""


class Model(_Strict):
    path: str | None = None
    container: str | None = None
    precision: str | None = None


class Resources(_Strict):
    gpu_type: str | None = None
    gpus_per_node: GpusPerNode | None = None


class Convert(_Strict):
    """``roles.decode.convert``: make the decode's weights folder with TileRT's converter.

    The folder is ``roles.decode.args.model-weights-dir``; agent.recipe.rules.weights checks
    these keys and docs/weights.md says what the agent does with them.
    """

    # The Hugging Face checkpoint: a path or a cluster ``model_paths`` alias.
    source: str | None = None
    # The converter's --model_type; from the decode model profile when left out.
    model_type: str | None = None
    # Add the MTP layer to an existing conversion (the converter's --append_mtp).
    append_mtp: bool = False
    # The interpreter that holds the converter (inside the decode image under pyxis).
    python: str = "python"


class Role(_Strict):
    """One engine role (``roles.prefill``, ``roles.decode``): its engine, layout, env and args."""

    # A string ("vllm") or a mapping with a ``type`` key ({type: vllm, ...}).
    engine: str | dict[str, Any] | None = None
    container: str | None = None
    nodes: Nodes | None = None
    workers: Nodes | None = None
    gpus: Gpus | None = None
    env: dict[str, EnvValue] = {}
    args: dict[str, ArgValue] = {}
    # Decode only: convert the weights folder when it is incomplete (docs/weights.md).
    convert: Convert | None = None


class Roles(_Strict):
    prefill: Role | None = None
    decode: Role | None = None
    # srtctl's aggregated workers (``agg``; ``aggregated`` in older recipes): accepted by the schema
    # so the rules can say why they are refused.
    agg: Role | None = None
    aggregated: Role | None = None


class Frontend(_Strict):
    type: str | None = None
    container_image: str | None = None
    enable_multiple_frontends: bool | None = None
    args: dict[str, ArgValue] = {}
    env: dict[str, EnvValue] = {}


class HealthCheck(_Strict):
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    interval_seconds: Interval | None = None


class Slurm(_Strict):
    account: str | None = None
    partition: str | None = None
    time_limit: str | None = None


class Benchmark(_Strict):
    """``benchmark:``: what runs once the job is ready (docs/benchmark.md, rules/benchmark.py)."""

    # manual (nothing runs), aiperf or custom.
    type: str | None = None
    # aiperf: synthetic input and output lengths, the levels, and how long each level runs.
    isl: Tokens | None = None
    osl: Tokens | None = None
    # A list, or srtctl's "1x4x16" string.
    concurrencies: list[Annotated[int, msgspec.Meta(ge=1, le=100_000)]] | str | None = None
    # Requests per second, or srtctl's "inf" (as fast as the concurrency allows).
    req_rate: Annotated[float, msgspec.Meta(gt=0, le=1_000_000)] | str | None = None
    num_requests: Annotated[int, msgspec.Meta(ge=1, le=100_000_000)] | None = None
    duration_s: Budget | None = None
    warmup_requests: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    # Default: frontend.args.model-path.
    tokenizer: str | None = None
    extra_args: list[str] = []
    # A fraction of the requests.
    max_error_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    aiperf_command: str | None = None
    # Both: the client's image under pyxis, where it runs, its environment.
    container_image: str | None = None
    client_placement: str | None = None
    env: dict[str, EnvValue] = {}
    # custom: the command (bash -c).
    command: str | None = None
    # Default false for aiperf and custom: the job ends after the benchmark.
    keep_serving: bool | None = None
    # custom: fail when the command leaves no AIPerf folder to judge (default false: passed,
    # with the note "no results to judge").
    require_results: bool | None = None
    # The whole benchmark's budget (both types); default BENCHMARK_TIMEOUT_S.
    timeout_s: Budget | None = None


# ---- our own section -------------------------------------------------------------------------


class PrefillPorts(_Strict):
    """Where a prefill agent starts probing for free ports; the chosen ones go in its record."""

    http: Port = 8100
    agent: Port = 9100
    ctrl: Port | None = None


class DecodePorts(_Strict):
    """Where a decode agent starts probing for free ports (each key defaults on its own)."""

    http: Port = 6100
    agent: Port = 9200
    ctrl: Port | None = 5600


class PortBases(_Strict):
    prefill: PrefillPorts = msgspec.field(default_factory=PrefillPorts)
    decode: DecodePorts = msgspec.field(default_factory=DecodePorts)


class Probe(_Strict):
    """Health probing cadence: fast while starting (readiness seen within ~50 ms), slower after."""

    startup_interval_s: Interval = 0.05
    interval_s: Interval = 1.0
    timeout_s: Interval = 2.0
    failure_threshold: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3


class RestartPolicy(_Strict):
    """Exponential backoff with a cap; ``max_restarts`` within ``window_s``: failed for good."""

    backoff_initial_s: Interval = 1.0
    backoff_max_s: Annotated[float, msgspec.Meta(gt=0, le=_DAY_S)] = 60.0
    # 0: a crash is final at once.
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 5
    window_s: Budget = 600.0


class Budgets(_Strict):
    """Per-role startup budgets (s)."""

    prefill: Budget | None = None
    decode: Budget | None = None
    router: Budget | None = None


class Graces(_Strict):
    """Per-role stop graces (s)."""

    prefill: Grace | None = None
    decode: Grace | None = None
    router: Grace | None = None


class Canary(_Strict):
    prompt: str = "Say hello."
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8
    # The whole proof's budget; each attempt (one chat) is cut at ``attempt_timeout_s`` and
    # retried while the budget lasts.
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=_DAY_S)] = 180.0
    # Default: CANARY_ATTEMPT_S, or timeout_s when that is shorter (canary_attempt_s).
    attempt_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=_DAY_S)] | None = None
    # Each decode's greedy answers checked against the prefill's own model (agent.head.verify).
    verify: bool = True
    # Nats per token the decode's answer may score below the prefill's own (docs/agent.md).
    verify_margin: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0


# An attempt's bound unless agent.canary.attempt_timeout_s says otherwise.
CANARY_ATTEMPT_S = 60.0


def canary_attempt_s(canary: Canary) -> float:
    """Each canary attempt's bound: the key's, else CANARY_ATTEMPT_S within the budget."""
    if canary.attempt_timeout_s is not None:
        return canary.attempt_timeout_s
    return min(CANARY_ATTEMPT_S, canary.timeout_s)


class LogSettings(_Strict):
    max_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 40)] = DEFAULT_LOG_MAX_BYTES
    backups: Annotated[int, msgspec.Meta(ge=0, le=1000)] = DEFAULT_LOG_BACKUPS
    # Where engine logs go: the job directory (``job``), or each node's own disk (``node``,
    # in ``node_dir``/<job folder name>/), read through the agents' /logs (docs/logs.md).
    location: Literal["job", "node"] = "job"
    node_dir: str = "/tmp/tilert-logs"


class AgentSection(_Strict):
    router_port: Port = 8000
    router_python: str = ROUTER_PYTHON
    # The command that starts vLLM (the model path is appended): ``vllm serve`` by default; a
    # site's own launcher, or ``[python, -m, vllm.entrypoints.openai.api_server]``.
    prefill_command: list[str] = msgspec.field(default_factory=lambda: list(PREFILL_PROGRAM))
    # The interpreter of TileRT's decode server, as ``router_python`` is the router's.
    decode_python: str = DECODE_PYTHON
    # Node-local scratch for the engines' temp and cache folders (TMPDIR, VLLM_CACHE_ROOT, ...):
    # None means a per-job folder under the node's system temp folder; ``job`` the job directory;
    # else an absolute path. Removed when the agent stops.
    scratch_dir: str | None = None
    # Address the agent's own endpoint binds to; None means the node's address.
    bind: str | None = None
    ports: PortBases = msgspec.field(default_factory=PortBases)
    probe: Probe = msgspec.field(default_factory=Probe)
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    # None for a role means srtctl's health_check budget (max_attempts x interval_seconds).
    startup_budget_s: Budgets = msgspec.field(default_factory=lambda: Budgets(router=300.0))
    # Startup deadlines that watch progress (docs/agent.md): a progress line in the engine's log
    # keeps its startup going this long past the budget; never past ``startup_max_s``.
    startup_silence_s: Annotated[float, msgspec.Meta(gt=0, le=_DAY_S)] = 900.0
    startup_max_s: Annotated[float, msgspec.Meta(gt=0, le=7 * _DAY_S)] = 14400.0
    stop_grace_s: Graces = msgspec.field(
        default_factory=lambda: Graces(prefill=20.0, decode=20.0, router=5.0)
    )
    canary: Canary = msgspec.field(default_factory=Canary)
    # How many times the head takes a dropped decode back once it is healthy again (a decode that
    # flaps past it stays out, with the reason); 0: a dropped decode never comes back.
    max_rejoins: Annotated[int, msgspec.Meta(ge=0, le=1000)] = DEFAULT_MAX_REJOINS
    # How long a decode in the router's list may be down (its engine restarting, its agent not
    # answering) before the head takes it out of the list until it is healthy again; null: never.
    down_decode_out_after_s: Annotated[float, msgspec.Meta(ge=0, le=_DAY_S)] | None = (
        DEFAULT_DOWN_DECODE_OUT_AFTER_S
    )
    logs: LogSettings = msgspec.field(default_factory=LogSettings)
    # The weights conversion's own budget, apart from the engine's startup budget, and when a
    # conversion lock nobody refreshes is taken over (docs/weights.md).
    convert_budget_s: Budget = DEFAULT_CONVERT_BUDGET_S
    convert_lock_stale_s: Annotated[float, msgspec.Meta(gt=0, le=_DAY_S)] = (
        DEFAULT_CONVERT_LOCK_STALE_S
    )
    # Version pins checked in each node's preflight against what each image really has:
    # package (tilert, vllm, nixl) -> version (docs/recipe.md; schema 1's identity.frameworks).
    frameworks: dict[str, str] = {}
    # pyxis flags added to every engine's srun step (schema 1's srun_options), from PYXIS_FLAGS.
    pyxis_flags: list[str] = []
    # The node checks before the load and what each finding does (docs/preflight.md).
    preflight: PreflightPolicy = msgspec.field(default_factory=PreflightPolicy)
    # The front door: the job's one stable OpenAI address, its retries (docs/agent.md).
    front: FrontPolicy = msgspec.field(default_factory=FrontPolicy)


def agent_keys() -> list[str]:
    """Every leaf key of the recipe's ``agent:`` section, dotted (``agent.probe.interval_s``)."""
    keys: list[str] = []

    def walk(struct: type[msgspec.Struct], prefix: str) -> None:
        for field in msgspec.structs.fields(struct):
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                walk(field.type, f"{prefix}{field.encode_name}.")
            else:
                keys.append(f"{prefix}{field.encode_name}")

    walk(AgentSection, "agent.")
    return keys


class ServiceFrontSettings(_Strict):
    """``service.front``: where the service front listens (an address that outlives every cell)."""

    host: str = "127.0.0.1"
    port: Port = 8090


class ReplaceBound(_Strict):
    """``service.replace``: how often a failed cell is replaced (docs/service.md)."""

    # Backoff between replacements of the same line of cells: first, doubled each time, at most.
    backoff_s: Annotated[float, msgspec.Meta(ge=0, le=_HOUR_S)] = 10.0
    backoff_max_s: Annotated[float, msgspec.Meta(ge=0, le=_DAY_S)] = 600.0
    # At most this many replacements in any hour; past it the service stays degraded and says so.
    max_per_hour: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 6


class Service(_Strict):
    """``service:``: the cells ``tilert-submit serve`` keeps behind one service front
    (docs/service.md); ignored by ``tilert-submit submit``."""

    # Cells serving at once in steady state.
    cells: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    front: ServiceFrontSettings = msgspec.field(default_factory=ServiceFrontSettings)
    # How long before a cell's end its successor is submitted: seconds, or ``auto`` (the last
    # cell's submit-to-ready time x SUCCESSOR_LEAD_FACTOR, plus the time it waited in the queue).
    successor_lead_s: Annotated[float, msgspec.Meta(gt=0, le=7 * _DAY_S)] | Literal["auto"] = "auto"
    # Cells at once during a succession; null: ``cells + 1``.
    max_cells: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    # How long a retired cell's streams may run on before it is stopped.
    drain_s: Annotated[float, msgspec.Meta(ge=0, le=_DAY_S)] = 60.0
    replace: ReplaceBound = msgspec.field(default_factory=ReplaceBound)


class Recipe(_Strict):
    """A whole recipe file (srtctl schema 2 plus the ``agent:`` section)."""

    schema: int | None = None
    name: str | None = None
    # srtctl's shared engine; refused together with role engines (see agent.recipe.rules).
    engine: str | dict[str, Any] | None = None
    model: Model = msgspec.field(default_factory=Model)
    resources: Resources = msgspec.field(default_factory=Resources)
    roles: Roles = msgspec.field(default_factory=Roles)
    frontend: Frontend = msgspec.field(default_factory=Frontend)
    health_check: HealthCheck = msgspec.field(default_factory=HealthCheck)
    slurm: Slurm = msgspec.field(default_factory=Slurm)
    environment: dict[str, EnvValue] = {}
    container_mounts: list[str] | dict[str, str] = []
    setup_script: str | None = None
    benchmark: Benchmark = msgspec.field(default_factory=Benchmark)
    agent: AgentSection = msgspec.field(default_factory=AgentSection)
    service: Service = msgspec.field(default_factory=Service)


# srtctl's health_check defaults when a recipe omits it: one hour, enough for a GLM-5 load.
DEFAULT_HEALTH_MAX_ATTEMPTS = 360
DEFAULT_HEALTH_INTERVAL_S = 10.0


# resources.gpus_per_node when neither the recipe nor the cluster file says (TileRT runs TP8).
DEFAULT_GPUS_PER_NODE = 8


def norm_arg(key: str) -> str:
    """An engine-arg key in canonical form (``_`` == ``-``, no leading dashes)."""
    return key.lstrip("-").replace("_", "-")


def find_arg(args: dict[str, ArgValue], name: str) -> tuple[str, ArgValue] | None:
    """The (key as the user wrote it, value) of arg ``name``, matching ``_`` and ``-`` alike."""
    want = norm_arg(name)
    for key, value in args.items():
        if norm_arg(key) == want:
            return key, value
    return None


def gpus_per_node(recipe: Recipe) -> int:
    """GPUs per node: the recipe's (cluster default merged in by the loader), else 8."""
    # 0 is a CPU-only cluster (the planner then wants stand-ins or explicit gpus: 0 roles).
    node_gpus = recipe.resources.gpus_per_node
    return DEFAULT_GPUS_PER_NODE if node_gpus is None else node_gpus


def role_layout(role: Role, node_gpus: int) -> tuple[int, int, int]:
    """(nodes, workers, gpus per worker) of a role, with srtctl's defaults for what is unset."""
    nodes = role.nodes if role.nodes is not None else (role.workers or 1)
    workers = role.workers if role.workers is not None else (role.nodes or 1)
    gpus = role.gpus if role.gpus is not None else (nodes * node_gpus) // max(workers, 1)
    return nodes, workers, gpus


def role_env(recipe: Recipe, role: Role | Frontend) -> dict[str, EnvValue]:
    """A role's (or the router's) environment: top-level ``environment`` overlaid by its ``env``."""
    return {**recipe.environment, **role.env}


def env_value(value: EnvValue) -> str:
    """An environment value as the engine sees it (YAML booleans as ``1`` / ``0``)."""
    # The rules compare this spelling too: TILERT_PD_NO_MTP: true and "1" are the same setting.
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def public_model_name(recipe: Recipe) -> str | None:
    """The name clients send: the prefill's served-model-name, else model.path."""
    prefill = recipe.roles.prefill
    found = find_arg(prefill.args, "served-model-name") if prefill else None
    if found is not None and isinstance(found[1], str):
        return found[1]
    return recipe.model.path


def engine_type(engine: str | dict[str, Any] | None) -> str | None:
    """The engine type of a role (``vllm`` from ``vllm`` or ``{type: vllm}``)."""
    if isinstance(engine, dict):
        value = engine.get("type")
        return value if isinstance(value, str) else None
    return engine
