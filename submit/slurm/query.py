"""What the cluster says about itself, for ``tilert-submit init``: each fact with its source.

Asked with the Slurm client commands (``sinfo``, ``scontrol show config|partition|node``,
``srun --help``, ``sacctmgr``), each bounded in time; the parsers are pure functions of the text
those commands print (Slurm 22.05 to 24.x spell these fields alike). A command that fails leaves
its facts unknown and says why: ``init`` then writes a question instead of a value.
"""

from __future__ import annotations

import getpass
import glob
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from submit.slurm.client import SlurmError, run_client

QUERY_TIMEOUT_S = 20.0
# What pyxis adds to srun's options (the SPANK plugin registers them).
PYXIS_FLAG = "--container-image"


@dataclass(frozen=True)
class Partition:
    """One partition as sinfo and scontrol describe it."""

    name: str
    default: bool
    state: str
    # sinfo %l: "infinite", "1-00:00:00", "4:00:00".
    time_limit: str
    # scontrol DefaultTime: "NONE" or a time.
    default_time: str
    nodes: int
    node_list: str
    # sinfo %G: "(null)", "gpu:8", "gpu:h100:8(S:0-1)".
    gres: str
    oversubscribe: str = "NO"


@dataclass(frozen=True)
class Node:
    """One compute node: its name, address, GRES and partitions."""

    name: str
    address: str
    gres: str
    partitions: tuple[str, ...]


@dataclass
class ClusterFacts:
    """Everything ``init`` learnt, and what it could not (command -> why)."""

    config: dict[str, str] = field(default_factory=dict)
    partitions: list[Partition] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    # None: unknown (srun --help failed); else whether pyxis is there and how it was seen.
    pyxis: bool | None = None
    pyxis_source: str = ""
    accounts: list[str] | None = None
    failures: dict[str, str] = field(default_factory=dict)

    def default_partition(self) -> Partition | None:
        """The partition marked default (sinfo's ``*``, scontrol's Default=YES)."""
        return next((p for p in self.partitions if p.default), None)


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = Value`` lines."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    """``scontrol show partition|node -o``: one record of ``Key=Value`` words a line."""
    records = []
    for line in text.splitlines():
        fields: dict[str, str] = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        if fields:
            records.append(fields)
    return records


def parse_sinfo(text: str) -> dict[str, dict[str, str]]:
    """``sinfo -h -o %P|%a|%l|%D|%G|%N`` -> partition -> its summary (``*`` marks the default)."""
    out = {}
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) != 6 or not cells[0]:
            continue
        name = cells[0]
        out[name.rstrip("*")] = {
            "default": "yes" if name.endswith("*") else "",
            "state": cells[1],
            "time_limit": cells[2],
            "nodes": cells[3],
            "gres": cells[4],
            "node_list": cells[5],
        }
    return out


def gpus_in_gres(gres: str) -> int:
    """The GPU count of a GRES string (``gpu:8``, ``gpu:h100:8(S:0-1)``); 0 without GPUs."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total = max(total, int(parts[-1]))
    return total


def gpu_types(gres: str) -> list[str]:
    """The GPU types a GRES string names (``h100`` in ``gpu:h100:8``)."""
    out = []
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) == 3:
            out.append(parts[1])
    return out


def combine_partitions(
    sinfo: Mapping[str, Mapping[str, str]], records: list[dict[str, str]]
) -> list[Partition]:
    """sinfo's summary with scontrol's Default, DefaultTime and OverSubscribe."""
    by_name = {r.get("PartitionName", ""): r for r in records}
    out = []
    for name, row in sinfo.items():
        record = by_name.get(name, {})
        out.append(
            Partition(
                name=name,
                default=bool(row["default"]) or record.get("Default") == "YES",
                state=row["state"],
                time_limit=row["time_limit"],
                default_time=record.get("DefaultTime", "NONE"),
                nodes=int(row["nodes"]) if row["nodes"].isdigit() else 0,
                node_list=row["node_list"],
                gres=row["gres"],
                oversubscribe=record.get("OverSubscribe", "NO"),
            )
        )
    return out


def _ask(facts: ClusterFacts, argv: list[str], env: Mapping[str, str] | None) -> str | None:
    try:
        return run_client(argv, timeout=QUERY_TIMEOUT_S, env=env).stdout
    except SlurmError as exc:
        facts.failures[" ".join(argv)] = str(exc)
        return None


def plugstack_mentions_pyxis(path: str) -> bool:
    """Whether the plugstack file (or a file it includes) loads pyxis."""
    seen: set[str] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            text = Path(current).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if words[0] == "include" and len(words) > 1:
                base = Path(current).parent
                todo += glob.glob(
                    str(base / words[1]) if not words[1].startswith("/") else words[1]
                )
            elif any("pyxis" in w for w in words):
                return True
    return False


def gather(env: Mapping[str, str] | None = None) -> ClusterFacts:
    """Ask the cluster; what a command could not say is in ``failures``."""
    facts = ClusterFacts()
    text = _ask(facts, ["scontrol", "show", "config"], env)
    if text is not None:
        facts.config = parse_config(text)
    sinfo = _ask(facts, ["sinfo", "-h", "-o", "%P|%a|%l|%D|%G|%N"], env)
    records = _ask(facts, ["scontrol", "show", "partition", "-o"], env)
    if sinfo is not None:
        facts.partitions = combine_partitions(parse_sinfo(sinfo), parse_records(records or ""))
    nodes = _ask(facts, ["scontrol", "show", "node", "-o"], env)
    for record in parse_records(nodes or ""):
        facts.nodes.append(
            Node(
                name=record.get("NodeName", ""),
                address=record.get("NodeAddr", ""),
                gres=record.get("Gres", "(null)"),
                partitions=tuple(p for p in record.get("Partitions", "").split(",") if p),
            )
        )
    _find_pyxis(facts, env)
    if "associations" in facts.config.get("AccountingStorageEnforce", ""):
        user = getpass.getuser()
        found = _ask(
            facts, ["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account"], env
        )
        if found is not None:
            facts.accounts = sorted({a.strip() for a in found.splitlines() if a.strip()})
    return facts


def _find_pyxis(facts: ClusterFacts, env: Mapping[str, str] | None) -> None:
    helped = _ask(facts, ["srun", "--help"], env)
    if helped is not None and PYXIS_FLAG in helped:
        facts.pyxis, facts.pyxis_source = True, f"`srun --help` lists {PYXIS_FLAG}"
        return
    plugstack = facts.config.get("PlugStackConfig", "(null)")
    if plugstack not in ("(null)", "") and plugstack_mentions_pyxis(plugstack):
        facts.pyxis, facts.pyxis_source = True, f"{plugstack} loads pyxis"
        return
    if helped is None:
        return  # unknown: srun could not be asked
    where = f"nor in {plugstack}" if plugstack not in ("(null)", "") else "and no PlugStackConfig"
    facts.pyxis = False
    facts.pyxis_source = f"no {PYXIS_FLAG} in `srun --help` {where}"
