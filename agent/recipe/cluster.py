"""The cluster file: site facts in srtctl's ``srtslurm.yaml`` spelling, plus how agents launch.

Found by ``--cluster FILE``, else ``$TILERT_CLUSTER_FILE``, else ``./srtslurm.yaml``, else none.
An existing srtctl cluster file can be used as is: srtctl keys that tilert-agent does not use are
reported as warnings (``read_cluster``), keys neither tool knows are errors with a "did you mean".
Recipe values win over the cluster defaults (the loader merges them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from agent.facts import NVIDIA_DEVICES_ENV, ROCM_DEVICES_ENVS, is_amd_gpu
from agent.problems import InputError, Problem, error, warning
from agent.recipe.textfile import read_text
from agent.recipe.typedyaml import (
    ShapeChecker,
    YamlSyntaxError,
    line_of,
    parse,
    suggest,
    yaml_problem,
)

CLUSTER_ENV = "TILERT_CLUSTER_FILE"
CLUSTER_FLAG = "--cluster"
CLUSTER_FILE_NAME = "srtslurm.yaml"

# srtctl's ClusterConfig keys that tilert-agent accepts and ignores (a warning says so).
SRTCTL_IGNORED_KEYS = frozenset(
    {
        "cluster",
        "default_gpu_exporter",
        "use_gpus_per_node_directive",
        "use_segment_sbatch_directive",
        "use_exclusive_sbatch_directive",
        "use_het_jobs",
        "default_sbatch_directives",
        "default_health_check",
        "srtctl_root",
        "output_dir",
        "cloud",
        "default_bash_preamble",
        "default_host_setup",
        "reporting",
        "telemetry",
        "nginx_raise_ulimit",
        "git_http_version",
        "preflight",
    }
)


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """What the site is like (srtslurm.yaml subset) and how tilert-agent runs there."""

    # ---- srtctl's keys (same spelling and meaning) ----
    default_account: str | None = None
    default_partition: str | None = None
    # sbatch --time format ("04:00:00", "1-00:00:00").
    default_time_limit: str | None = None
    # 0: a CPU-only cluster (tests, demos): stand-ins or roles with gpus: 0.
    gpus_per_node: Annotated[int, msgspec.Meta(ge=0, le=128)] | None = None
    # resources.gpu_type when the recipe leaves it out (b200, mi355x, ...).
    default_gpu_type: str | None = None
    # Interface whose address agents advertise; "lo" means 127.0.0.1 (local runs and tests).
    network_interface: str | None = None
    # Image aliases: recipe value -> image (.sqsh path or registry reference).
    containers: dict[str, str] = {}
    # Model aliases: model.path value -> path on the compute nodes.
    model_paths: dict[str, str] = {}
    # Mounts for every job: host path -> container path.
    default_mounts: dict[str, str] = {}
    visible_devices_env: str = NVIDIA_DEVICES_ENV
    # ---- ours ----
    # pyxis: each engine in a nested `srun --container-image` step; process: plain child processes.
    launcher: Literal["pyxis", "process"] = "pyxis"
    # Where setup scripts are looked up on the compute nodes (inside the image under pyxis).
    configs_dir: str = "/configs"
    # Slurm's KillWait: stop graces are capped to fit inside it.
    kill_wait_s: Annotated[float, msgspec.Meta(gt=0, le=65533)] = 30.0
    # How compute nodes start tilert-agent (argv list or a shell-style string); None: the same
    # interpreter and package as the submitter.
    agent_command: list[str] | str | None = None
    exclusive: bool = True
    # sbatch --signal=TERM@<lead>: agents drain this many seconds before the time limit.
    # Slurm takes 0-65535.
    signal_lead_s: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 120


def find_cluster_file(flag: str | None, env: Mapping[str, str], cwd: Path) -> Path | None:
    """``--cluster``, else ``$TILERT_CLUSTER_FILE``, else ``./srtslurm.yaml``, else None."""
    for value, name in ((flag, CLUSTER_FLAG), (env.get(CLUSTER_ENV), CLUSTER_ENV)):
        if value:
            path = Path(value).expanduser()
            path = path if path.is_absolute() else cwd / path
            try:
                path.stat()
            except OSError as exc:
                what = (
                    "does not exist"
                    if isinstance(exc, FileNotFoundError)
                    else f"cannot be used: {exc.strerror or exc}"
                )
                raise InputError(
                    [
                        error(
                            name,
                            f"cluster file {value} {what}",
                            f"pass an existing srtslurm.yaml with {CLUSTER_FLAG} FILE, or unset "
                            f"{CLUSTER_ENV}",
                        )
                    ],
                    name,
                ) from None
            # Anything else that exists (a directory, a FIFO) is refused when it is read.
            return path
    default = cwd / CLUSTER_FILE_NAME
    try:
        return default if default.is_file() else None
    except OSError:  # an unusable working directory: no default cluster file
        return None


def relative_to_file(value: str, base_dir: Path) -> str:
    """A ``./`` or ``../`` path made absolute against ``base_dir`` (its file's folder); else as
    is."""
    if value.startswith(("./", "../")) or value in (".", ".."):
        return str((base_dir / value).resolve())
    return value


def local_path(value: str, base_dir: Path) -> str:
    """A host path of the recipe as this host reads it (``~`` expanded, relative to the file)."""
    if value.startswith("~"):
        return os.path.expanduser(value)
    return relative_to_file(value, base_dir)


def mount_spec(spec: str, base_dir: Path) -> str:
    """A mount spec with its host side as this host reads it."""
    host, sep, rest = spec.partition(":")
    return local_path(host, base_dir) + sep + rest


def _semantic_problems(cluster: ClusterConfig) -> list[Problem]:
    problems: list[Problem] = []
    for name, image in cluster.containers.items():
        if not image.strip():
            problems.append(
                error(f"containers.{name}", "the image is empty", "write a .sqsh path or image")
            )
    if not cluster.visible_devices_env.isidentifier():
        problems.append(
            error(
                "visible_devices_env",
                f"'{cluster.visible_devices_env}' is not an environment variable name",
                "use CUDA_VISIBLE_DEVICES (NVIDIA) or ROCR_VISIBLE_DEVICES (AMD)",
            )
        )
    elif cluster.default_gpu_type and is_amd_gpu(cluster.default_gpu_type):
        problems += devices_problems(cluster.default_gpu_type, cluster, "default_gpu_type")
    for host, inside in cluster.default_mounts.items():
        wrong = mount_problem(f"{host}:{inside}")
        if wrong is not None:
            problems.append(error(f"default_mounts.{host}", wrong, MOUNT_HINT))
    if isinstance(cluster.agent_command, list) and not cluster.agent_command:
        problems.append(
            error("agent_command", "the command is empty", "remove it to use the default")
        )
    return problems


# Mount flags pyxis passes on to enroot ("+"-separated: ro+rprivate).
MOUNT_FLAGS = frozenset(
    {
        "ro",
        "rw",
        "bind",
        "rbind",
        "private",
        "rprivate",
        "slave",
        "rslave",
        "shared",
        "rshared",
        "nosuid",
        "nodev",
        "noexec",
        "x-create=dir",
        "x-create=file",
        "x-create=auto",
    }
)


def mount_problem(spec: str) -> str | None:
    """What is wrong with a container mount for pyxis (``SRC:DST[:FLAGS]``); None when fine."""
    if "," in spec:
        return "a mount cannot hold ',' (pyxis separates mounts with it)"
    parts = spec.split(":")
    if len(parts) > 3:
        return "has more than SRC:DST:FLAGS (':' separates them)"
    src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
    for what, path in (("SRC", src), ("DST", dst)):
        if not path.startswith("/"):
            return f"{what} {path!r} is not an absolute path"
    flags = parts[2].split("+") if len(parts) == 3 else []
    unknown = [f for f in flags if f not in MOUNT_FLAGS]
    if unknown:
        return f"unknown mount flag {unknown[0]!r} (pyxis takes {', '.join(sorted(MOUNT_FLAGS))})"
    return None


MOUNT_HINT = "write host:container[:flags] with absolute paths, flags joined by '+' (ro+rprivate)"


def devices_problems(gpu_type: str, cluster: ClusterConfig | None, path: str) -> list[Problem]:
    """An AMD ``gpu_type`` on a cluster whose GPUs are selected with NVIDIA's variable."""
    if not is_amd_gpu(gpu_type):
        return []
    current = cluster.visible_devices_env if cluster is not None else NVIDIA_DEVICES_ENV
    if current in ROCM_DEVICES_ENVS:
        return []
    where = "the cluster file" if cluster is not None else f"the cluster file ({CLUSTER_FILE_NAME})"
    said = (
        f"visible_devices_env is {current}"
        if cluster is not None
        else f"there is no cluster file, so GPUs are selected with {current}"
    )
    return [
        error(
            path,
            f"{gpu_type} is an AMD GPU, but {said}: ROCm engines are pinned to their GPUs with "
            f"{ROCM_DEVICES_ENVS[0]} (tilert-agent does not guess it from gpu_type)",
            f"set visible_devices_env: {ROCM_DEVICES_ENVS[0]} in {where}",
        )
    ]


def read_cluster(path: Path) -> tuple[ClusterConfig, list[Problem]]:
    """Load and check a cluster file: (config, warnings). Raises InputError with every error."""
    source = str(path)
    try:
        raw, lines, problems = parse(read_text(path, "cluster file"))
    except YamlSyntaxError as exc:
        raise InputError([yaml_problem(exc)], source) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(
            [error("", "the top level must be a mapping of cluster keys", "see docs/recipe.md")],
            source,
        )
    warnings = [
        warning(
            key, "srtctl cluster key not used by tilert-agent", "remove it or keep it for srtctl"
        )
        for key in raw
        if key in SRTCTL_IGNORED_KEYS
    ]
    raw = {k: v for k, v in raw.items() if k not in SRTCTL_IGNORED_KEYS}
    checker = ShapeChecker()
    _, cleaned = checker.check(raw, msgspec.inspect.type_info(ClusterConfig))
    problems = [*problems, *checker.problems]
    # What was wrong is pruned: the rest is still checked, so one run reports every problem.
    base = path.resolve().parent
    cleaned["model_paths"] = {
        k: relative_to_file(v, base) for k, v in cleaned.get("model_paths", {}).items()
    }
    cluster = msgspec.convert(cleaned, ClusterConfig)
    problems += [p for p in _semantic_problems(cluster) if p.path not in checker.pruned]
    problems = [
        p if p.line is not None else msgspec.structs.replace(p, line=line_of(p.path, lines))
        for p in [*problems, *warnings]
    ]
    if any(p.severity == "error" for p in problems):
        raise InputError(problems, source)
    return cluster, problems


def load_cluster(path: Path) -> ClusterConfig:
    """Load and check a cluster file (warnings dropped; use ``read_cluster`` to print them)."""
    return read_cluster(path)[0]


def is_image_reference(value: str) -> bool:
    """Whether an image value is a reference as written (a path, a registry ref, a .sqsh file)."""
    return "/" in value or ":" in value or value.endswith(".sqsh")


def resolve_image(value: str, cluster: ClusterConfig | None, key: str) -> str:
    """A cluster alias -> its image; a reference as is; any other bare word -> InputError."""
    if cluster is not None and value in cluster.containers:
        return cluster.containers[value]
    if is_image_reference(value):
        return value
    aliases = sorted(cluster.containers) if cluster is not None else []
    close = suggest(value, aliases)
    if close is not None:
        hint = f"did you mean '{close}'? (aliases in the cluster file: {', '.join(aliases)})"
    elif aliases:
        hint = (
            f"use one of the cluster file's aliases ({', '.join(aliases)}), a .sqsh path, "
            f"or a registry reference such as {value}:latest"
        )
    elif cluster is None:
        hint = (
            f"define it under 'containers:' in {CLUSTER_FILE_NAME} ({CLUSTER_FLAG} FILE), or "
            f"write a .sqsh path or a registry reference such as {value}:latest"
        )
    else:
        hint = (
            "the cluster file defines no 'containers:' aliases; add one, or write a .sqsh path "
            f"or a registry reference such as {value}:latest"
        )
    raise InputError(
        [error(key, f"'{value}' is neither a cluster image alias nor an image reference", hint)]
    )


def merged_mounts(recipe_mounts: Any, cluster: ClusterConfig | None) -> Any:
    """Recipe mounts with the cluster's default_mounts added (the recipe wins for a host path)."""
    if cluster is None or not cluster.default_mounts:
        return recipe_mounts
    if isinstance(recipe_mounts, list):
        listed = {str(m).split(":", 1)[0] for m in recipe_mounts}
        extra = [f"{h}:{c}" for h, c in cluster.default_mounts.items() if h not in listed]
        return [*extra, *recipe_mounts]
    return {**cluster.default_mounts, **(recipe_mounts or {})}
