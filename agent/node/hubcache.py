"""A hub id's checkpoint found in the decode's Hugging Face cache, as srtctl schema 1 finds it.

srtctl's TileRT backend converts an ``hf:`` model from ``snapshot_download(<id>,
local_files_only=True)``: the snapshot the cache's ``refs/main`` names, nothing downloaded. A
``roles.decode.convert.source`` that is a hub id means the same here (docs/weights.md): the cache
is the decode's ``HF_HUB_CACHE`` (or ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME``/hub, else
``~/.cache/huggingface/hub``), a path as the engine sees it; the agent reads it on its node
(under pyxis: back through the job's container mounts, agent.node.mounts). File system calls
block: call ``snapshot`` from a worker thread.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.errors import RuntimeFailure
from agent.node.mounts import host_path

DEFAULT_HUB_CACHE = "~/.cache/huggingface/hub"


class HubCacheError(RuntimeFailure):
    """The hub id's snapshot is not in the cache; the message says where it looked and how to
    get it there."""


def hub_cache(env: Mapping[str, str]) -> str:
    """The Hugging Face hub cache folder an environment names (as the engine sees it)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return env[name]
    if env.get("HF_HOME"):
        return posixpath.join(env["HF_HOME"], "hub")
    return os.path.expanduser(DEFAULT_HUB_CACHE)


def snapshot(hub_id: str, env: Mapping[str, str], mounts: Sequence[str], launcher: str) -> str:
    """The snapshot folder of ``hub_id`` (``org/name``) as the engine sees it."""

    def to_host(path: str) -> Path:
        found = host_path(path, mounts, launcher)
        if found is None:
            raise HubCacheError(
                f"the Hugging Face cache folder {path} is not under any of the job's container "
                "mounts: mount it, or set roles.decode.convert.source to the checkpoint folder"
            )
        return found

    cache = hub_cache(env)
    repo = posixpath.join(cache, "models--" + hub_id.replace("/", "--"))
    host = to_host(repo)
    how = (
        f"download it on a node that sees the cache (HF_HUB_CACHE={cache} huggingface-cli "
        f"download {hub_id}), or set roles.decode.convert.source to the checkpoint folder"
    )
    try:
        revision = (host / "refs" / "main").read_text().strip()
    except FileNotFoundError:
        snapshots = sorted(p.name for p in (host / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) != 1:
            raise HubCacheError(
                f"{hub_id} is not in the Hugging Face cache {cache} (no {repo}/refs/main): {how}"
            ) from None
        revision = snapshots[0]
    except OSError as exc:
        raise HubCacheError(f"cannot read {repo}/refs/main: {exc}; {how}") from None
    folder = posixpath.join(repo, "snapshots", revision)
    if not (to_host(folder)).is_dir():
        raise HubCacheError(f"{hub_id}'s snapshot {folder} (refs/main) is missing: {how}")
    return folder
