"""What only the submit host can check in a recipe, and a node re-reading J/recipe.yaml cannot.

The cluster's GPU variable for the recipe's GPU, the recipe's own container mounts in pyxis's
form, and a conversion source this host can read. The loader runs these on the submit host only
(``on_submit_host``).
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.facts import CONVERTER_INPUTS
from agent.problems import Problem, error, warning
from agent.recipe.cluster import (
    MOUNT_HINT,
    ClusterConfig,
    devices_problems,
    local_path,
    mount_problem,
    mount_spec,
)
from agent.recipe.model import Recipe
from agent.recipe.rules.weights import CONVERT


def submit_host_problems(
    recipe: Recipe, resolved: Recipe, cluster: ClusterConfig | None, base_dir: Path
) -> list[Problem]:
    """What the submit host can check and a node re-reading J/recipe.yaml cannot: the cluster's
    GPU variable for the recipe's GPU, the recipe's own mounts, the conversion source it sees."""
    found = _mount_problems(recipe.container_mounts, base_dir)
    if recipe.resources.gpu_type:  # the cluster's default_gpu_type is checked with its file
        found += devices_problems(recipe.resources.gpu_type, cluster, "resources.gpu_type")
    return found + _source_problems(resolved)


def _mount_problems(mounts: list[str] | dict[str, str], base_dir: Path) -> list[Problem]:
    """The recipe's own mounts in pyxis's form (the cluster's are checked with its file)."""
    if isinstance(mounts, list):
        pairs = [(f"container_mounts[{i}]", mount_spec(m, base_dir)) for i, m in enumerate(mounts)]
    else:
        pairs = [
            (f"container_mounts.{h}", f"{local_path(h, base_dir)}:{c}") for h, c in mounts.items()
        ]
    return [
        error(path, f"{spec!r}: {wrong}", MOUNT_HINT)
        for path, spec in pairs
        if (wrong := mount_problem(spec)) is not None
    ]


def _source_problems(recipe: Recipe) -> list[Problem]:
    """A conversion source the submit host can read holds what the converter requires."""
    decode = recipe.roles.decode
    source = decode.convert.source if decode is not None and decode.convert else None
    if not source or not source.startswith("/"):
        return []
    path = f"{CONVERT}.source"
    try:
        names = set(os.listdir(source))
    except OSError as exc:
        return [
            warning(
                path,
                f"{source} cannot be read from this host ({exc.strerror or exc}); it is checked "
                "on the decode node before the conversion",
                "nothing to do if the compute nodes see it; else fix the path",
            )
        ]
    missing = [name for name in CONVERTER_INPUTS if name not in names]
    if not missing:
        return []
    return [
        error(
            path,
            f"{source} is not a Hugging Face checkpoint: it has no {' and no '.join(missing)}, "
            "which TileRT's converter reads",
            "point it at the checkpoint folder (config.json, model.safetensors.index.json and "
            "the shards)",
        )
    ]
