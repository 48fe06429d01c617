"""Paths as an engine sees them (inside its pyxis container) mapped to this node's own paths.

Under pyxis the engine (and the converter) see the job's container mounts
(``HOST:CONTAINER[:FLAGS]``); the agent, outside the container, reads the same files through the
host side of the innermost mount that holds them. The process launcher has no mounts: a path is
the same for both.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path


def mounted(path: str, mounts: Sequence[str]) -> tuple[str, str] | None:
    """(host folder, container folder) of the innermost mount holding ``path``; None."""
    best: tuple[str, str] | None = None
    for mount in mounts:
        host, _, rest = mount.partition(":")
        inside = posixpath.normpath(rest.partition(":")[0] or host)
        if (path == inside or path.startswith(inside.rstrip("/") + "/")) and (
            best is None or len(inside) > len(best[1])
        ):
            best = (host, inside)
    return best


def host_path(path: str, mounts: Sequence[str], launcher: str) -> Path | None:
    """A path as the engine sees it, on this node (pyxis: through the mounts); None: unmounted."""
    engine = posixpath.normpath(path)
    if launcher != "pyxis":
        return Path(engine)
    found = mounted(engine, mounts)
    if found is None:
        return None
    host, inside = found
    relative = posixpath.relpath(engine, inside)
    return Path(host) if relative == "." else Path(host) / relative
