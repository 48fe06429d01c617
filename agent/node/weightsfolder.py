"""A TileRT weights folder: complete or not, its completion marker, and its hidden siblings;
where it lies as the agent sees it and as the engine sees it (``weights_paths``, pyxis mounts).

TileRT's converter writes straight into its ``--save_dir``: shards one after the other, the index
(``model.safetensors.index.json``) last. A converter that is killed (time limit, preemption, a full
disk) leaves a folder that looks converted, and the decode server then loads it and crashes, or
serves garbage, an hour later. So a folder is **complete** only when it holds our marker
``.tilert-converted.json`` (written by the agent after the converter succeeded, with the index
file's SHA-256) and the index still has that digest, and every shard the index names is there and
whole (its safetensors framing says how long it must be). Nothing else counts, not even an index
with every shard: only the marker says the converter finished.

Every sibling the agent makes lives in the folder's parent, so a rename never crosses file systems::

    .<name>.tilert-lock               the conversion lock (agent.node.folderlock)
    .<name>.tilert-converting-<id>    a conversion in progress (the converter's --save_dir)
    .<name>.tilert-replaced-<id>      an incomplete folder moved aside, being deleted

File system calls here block (a shared file system can stall for seconds): call them from a
worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import posixpath
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agent.errors import RuntimeFailure
from agent.facts import WEIGHTS_INDEX_FILE
from agent.job.atomicfile import is_temp_name, write_atomic
from agent.node.mounts import host_path, mounted

MARKER_NAME = ".tilert-converted.json"
MARKER_SCHEMA = 1
SHARD_SUFFIX = ".safetensors"
# How many missing or damaged shards a message names (the count says the rest).
_NAMED = 3
# A safetensors header larger than this is not one (the format caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


class ConvertedMarker(msgspec.Struct, kw_only=True):
    """``.tilert-converted.json``: who converted this folder, from what, when, and its index."""

    schema: int = MARKER_SCHEMA
    # The program that converted it and the tilert version it ran with ("unknown" if not found).
    converter: str
    converter_version: str
    source: str
    model_type: str
    # The MTP layer was appended to an existing conversion (--append_mtp), not converted with it.
    append_mtp: bool
    converted_at: float
    converted_at_utc: str
    index_file: str
    index_sha256: str
    shards: int
    total_bytes: int
    # The agent, node and job directory that converted it.
    agent: str
    node: str
    job: str


@dataclass
class Inspection:
    """What a folder holds; ``problems`` empty means complete."""

    folder: Path
    exists: bool
    marker: ConvertedMarker | None = None
    problems: list[str] = field(default_factory=list)
    # The index and every shard it names are there and whole (whatever the marker says).
    shards_complete: bool = False
    shard_count: int = 0
    index_sha256: str | None = None
    total_bytes: int = 0
    # Entries that are not weights files (the agent never deletes them).
    foreign: list[str] = field(default_factory=list)
    # The folder exists and holds nothing at all.
    empty: bool = False

    @property
    def complete(self) -> bool:
        """The folder may be served."""
        return self.exists and not self.problems

    def summary(self) -> str:
        """What is wrong, in one sentence."""
        return "; ".join(self.problems) if self.problems else "complete"


@dataclass(frozen=True)
class Siblings:
    """The paths the agent uses beside ``folder`` (same parent, same file system)."""

    folder: Path

    @property
    def _prefix(self) -> str:
        return f".{self.folder.name}.tilert-"

    @property
    def lock(self) -> Path:
        """The conversion lock file."""
        return self.folder.parent / f"{self._prefix}lock"

    def converting(self, token: str) -> Path:
        """The folder a conversion writes into."""
        return self.folder.parent / f"{self._prefix}converting-{token}"

    def replaced(self, token: str) -> Path:
        """Where an incomplete folder is moved before it is deleted."""
        return self.folder.parent / f"{self._prefix}replaced-{token}"

    def leftovers(self, keep: str) -> list[Path]:
        """Conversions and moved-aside folders of dead holders (not ``keep``'s), stale lock
        copies."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.folder.parent):
                name = entry.name
                if not name.startswith(self._prefix) or keep in name:
                    continue
                rest = name[len(self._prefix) :]
                if rest.startswith(("converting-", "replaced-", "lock.stale-")):
                    found.append(Path(entry.path))
        return found


def is_weights_file(name: str) -> bool:
    """A file a TileRT conversion (or this agent) writes: shards, the index, our marker."""
    return (
        name.endswith(SHARD_SUFFIX)
        or name in (WEIGHTS_INDEX_FILE, MARKER_NAME)
        or is_temp_name(name)
    )


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_problem(path: Path) -> str | None:
    """Why a shard is not whole (missing, not safetensors, cut short), or None."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is cut short ({size} bytes)"
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                return f"{path.name} is not a whole safetensors file ({size} bytes)"
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (OSError, ValueError) as exc:
        return f"{path.name} cannot be read as safetensors ({exc})"
    if not isinstance(header, dict):
        return f"{path.name} has no safetensors header"
    ends = [
        int(info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict) and "data_offsets" in info
    ]
    want = 8 + length + max(ends, default=0)
    if size < want:
        return f"{path.name} is cut short ({size} of {want} bytes)"
    return None


def _named(items: list[str]) -> str:
    shown = ", ".join(items[:_NAMED])
    return shown + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")


def _shards(folder: Path, out: Inspection) -> None:
    """Check the index and every shard it names; fill ``out``."""
    index = folder / WEIGHTS_INDEX_FILE
    try:
        data = index.read_bytes()
    except FileNotFoundError:
        out.problems.append(f"no {WEIGHTS_INDEX_FILE} (the converter writes it last)")
        return
    out.index_sha256 = hashlib.sha256(data).hexdigest()
    try:
        weight_map = json.loads(data)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        out.problems.append(f"{WEIGHTS_INDEX_FILE} is not a safetensors index (no weight_map)")
        return
    out.shard_count = len(shards)
    bad: list[str] = []
    for name in shards:
        path = folder / name
        problem = shard_problem(path)
        if problem is not None:
            bad.append(problem)
            continue
        with contextlib.suppress(OSError):
            out.total_bytes += path.stat().st_size
    if bad:
        out.problems.append(
            f"the index names {len(shards)} shards and {len(bad)} are not whole: {_named(bad)}"
        )
    out.shards_complete = not bad


def inspect(folder: Path, *, marker_required: bool = True) -> Inspection:
    """Whether ``folder`` is complete, and if not, why (every shard is checked either way)."""
    out = Inspection(folder=folder, exists=folder.is_dir())
    if not out.exists:
        out.problems.append("the folder does not exist" if not folder.exists() else "not a folder")
        return out
    try:
        entries = list(os.scandir(folder))
    except OSError as exc:
        out.problems.append(f"cannot list it ({exc})")
        return out
    out.empty = not entries
    out.foreign = sorted(e.name for e in entries if not (e.is_file() and is_weights_file(e.name)))
    _shards(folder, out)
    if not marker_required:
        return out
    try:
        out.marker = msgspec.json.decode((folder / MARKER_NAME).read_bytes(), type=ConvertedMarker)
    except FileNotFoundError:
        what = "an index and every shard it names, but" if out.shards_complete else ""
        out.problems.insert(
            0,
            f"{what} no {MARKER_NAME} "
            "(written by tilert-agent once a conversion has finished)".strip(),
        )
        return out
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        out.problems.insert(0, f"{MARKER_NAME} is unreadable ({exc})")
        return out
    if out.index_sha256 is not None and out.marker.index_sha256 != out.index_sha256:
        out.problems.insert(
            0,
            f"{WEIGHTS_INDEX_FILE} changed after the conversion finished (its SHA-256 differs "
            f"from the one in {MARKER_NAME})",
        )
    return out


def write_marker(folder: Path, marker: ConvertedMarker) -> None:
    """Write the marker into ``folder`` (atomically: a reader sees all of it or nothing)."""
    write_atomic(folder / MARKER_NAME, msgspec.json.format(msgspec.json.encode(marker)) + b"\n")


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (0 when it is gone)."""
    total = 0
    for path in _walk(folder):
        with contextlib.suppress(OSError):
            total += path.stat(follow_symlinks=False).st_size
    return total


def _walk(folder: Path) -> Iterator[os.DirEntry[str]]:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        else:
            yield entry


def copy_for_append(folder: Path, into: Path) -> None:
    """Prepare ``into`` as a copy of the conversion in ``folder`` for ``--append_mtp``.

    Shards are hard links (the converter only adds files); the index is a real copy, because the
    converter rewrites it in place and a shared inode would change ``folder``'s index too.
    """
    into.mkdir()
    for entry in os.scandir(folder):
        if not entry.is_file() or entry.name == MARKER_NAME or is_temp_name(entry.name):
            continue
        target = into / entry.name
        if entry.name == WEIGHTS_INDEX_FILE:
            shutil.copy2(entry.path, target)
            continue
        try:
            os.link(entry.path, target)
        except OSError:  # a file system without hard links
            shutil.copy2(entry.path, target)


def replace_folder(new: Path, folder: Path, aside: Path) -> None:
    """Put the complete folder ``new`` at ``folder`` by rename.

    A missing or empty ``folder`` is replaced in one ``rename``. Otherwise the old one is renamed
    to ``aside`` first, then ``new`` into place, then ``aside`` deleted: at no moment does
    ``folder`` hold anything but the old content or the new one (it is briefly absent).
    """
    try:
        os.rename(new, folder)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        os.rename(folder, aside)
        os.rename(new, folder)
        remove_tree(aside)
    sync_dir(folder.parent)


def remove_tree(path: Path) -> None:
    """Delete a folder or file the agent made (gone already is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        path.unlink()


def sync_dir(path: Path) -> None:
    """fsync a directory, so renames in it survive a crash of the node (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class WeightsError(RuntimeFailure):
    """The weights folder cannot be served; the message says why and what to do."""


@dataclass(frozen=True)
class WeightsPaths:
    """The weights folder as the agent sees it (``host``) and as the engine sees it."""

    host: Path
    engine: str
    # Whether the engine also sees the folder's siblings (a conversion writes into one).
    siblings_visible: bool

    def engine_path(self, sibling: Path) -> str:
        """A sibling of the folder as the engine (and the converter) see it."""
        return posixpath.join(posixpath.dirname(self.engine), sibling.name)


def weights_paths(folder: str, mounts: Sequence[str], launcher: str) -> WeightsPaths:
    """Map the engine's ``--model-weights-dir`` to this node's path (pyxis: through the mounts)."""
    engine = posixpath.normpath(folder)
    path = host_path(engine, mounts, launcher)
    if path is None:
        raise WeightsError(
            f"the weights folder {folder} (roles.decode.args.model-weights-dir) is not under any "
            "of the job's container mounts, so the agent cannot check it on the node; mount the "
            "folder that holds it (container_mounts, or the cluster's default_mounts)"
        )
    found = mounted(engine, mounts) if launcher == "pyxis" else None
    return WeightsPaths(path, engine, siblings_visible=found is None or engine != found[1])
