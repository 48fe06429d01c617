"""``tilert-submit init [-o FILE] [--force]``: ask the cluster and this login node, write a
commented cluster file (``submit.outfile``: a new regular file, an existing one with ``--force``, or
standard output with ``-o -``).

Every value says where it came from (the command and what it printed); what cannot be learnt is
left as a commented question (``# ?``). The file is the cluster file ``tilert-submit`` reads
(``--cluster FILE``, ``./srtslurm.yaml``; docs/recipe.md), and is checked by the same reader
before it is written.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import psutil
import yaml

from agent.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME
from agent.problems import InputError, printable, render_problems
from agent.recipe.cluster import CLUSTER_FILE_NAME, read_cluster
from submit import PROG
from submit.outfile import STDOUT, output_problem, write_output
from submit.slurm.query import ClusterFacts, Partition, gather, gpu_types, gpus_in_gres

WIDTH = 100
# GPU types that mean an AMD node (ROCR_VISIBLE_DEVICES selects its GPUs).
AMD_GPU_HINTS = ("mi", "amd", "instinct")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``init``'s flags."""
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=CLUSTER_FILE_NAME,
        help=f"where to write the cluster file (default: ./{CLUSTER_FILE_NAME}, the file "
        f"{PROG} reads by default; {STDOUT} prints it); a new regular file",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace FILE when it exists (a regular file only; it is never merged)",
    )


def _q(value: str) -> str:
    """A YAML scalar as one line (strings that YAML would read otherwise are quoted)."""
    dumped = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return dumped.strip().removesuffix("...").strip()


def _partitions(facts: ClusterFacts, out: list[str]) -> Partition | None:
    out.append("# ---- Slurm (asked on this login node) ----")
    if not facts.partitions:
        why = facts.failures.get("sinfo -h -o %P|%a|%l|%D|%G|%N", "sinfo listed no partition")
        out += [f"# ? which partition should jobs use? (sinfo: {why})", "# default_partition: gpu"]
        return None
    out.append("# Partitions (sinfo; * marks the default):")
    for p in facts.partitions:
        star = "*" if p.default else ""
        out.append(
            f"#   {p.name}{star}: {p.state}, time limit {p.time_limit}, {p.nodes} nodes "
            f"({p.node_list}), GRES {p.gres}"
        )
    default = facts.default_partition()
    if default is None:
        out += [
            "# ? no partition is marked default (sinfo shows no *): which one should jobs use?",
            f"# default_partition: {facts.partitions[0].name}",
        ]
        return None
    out += [
        f"# From sinfo / scontrol show partition: {default.name} is the default partition.",
        f"default_partition: {_q(default.name)}",
    ]
    return default


def _time_limit(part: Partition | None, out: list[str]) -> None:
    if part is not None and part.default_time not in ("NONE", "", "UNLIMITED"):
        out += [
            f"# From scontrol show partition {part.name}: DefaultTime={part.default_time}.",
            f"default_time_limit: {_q(part.default_time)}",
        ]
    elif part is not None and part.time_limit not in ("infinite", "UNLIMITED", ""):
        out += [
            f"# From sinfo: partition {part.name} allows at most {part.time_limit} and sets no "
            "default; jobs ask for the maximum.",
            f"default_time_limit: {_q(part.time_limit)}",
        ]
    else:
        limit = part.time_limit if part is not None else "unknown"
        out += [
            f"# ? how long may a job run? (sinfo: time limit {limit}, no DefaultTime): sbatch "
            "--time, e.g.",
            '# default_time_limit: "04:00:00"',
        ]


def _account(facts: ClusterFacts, out: list[str]) -> None:
    enforce = facts.config.get("AccountingStorageEnforce")
    if enforce is None:
        out.append("# ? does Slurm require an account? (scontrol show config did not answer)")
        out.append("# default_account: my-account")
    elif "associations" not in enforce:
        out.append(
            f"# No account needed: AccountingStorageEnforce={enforce} (scontrol show config)."
        )
    elif facts.accounts:
        listed = ", ".join(facts.accounts)
        out += [
            f"# Slurm requires an account (AccountingStorageEnforce={enforce}); sacctmgr lists "
            f"yours: {listed}.",
            f"default_account: {_q(facts.accounts[0])}",
        ]
    else:
        out += [
            f"# ? Slurm requires an account (AccountingStorageEnforce={enforce}) and sacctmgr "
            "named none of yours: which one?",
            "# default_account: my-account",
        ]


def _gpus(facts: ClusterFacts, part: Partition | None, out: list[str]) -> None:
    gres = part.gres if part is not None else ""
    nodes = [n for n in facts.nodes if part is None or part.name in n.partitions]
    counts = {gpus_in_gres(n.gres) for n in nodes} | ({gpus_in_gres(gres)} if gres else set())
    if not counts:
        out += ["# ? how many GPUs does a node have? (no GRES could be read)", "# gpus_per_node: 8"]
        return
    gpus = max(counts)
    where = f"partition {part.name}" if part is not None else "the nodes"
    if gpus == 0:
        out += [
            f"# From sinfo %G / scontrol show node: no GPU GRES on {where} ({gres or '(null)'}): a "
            "CPU-only cluster. Jobs run the stand-ins (--mock) or roles with gpus: 0.",
            "gpus_per_node: 0",
        ]
    else:
        mixed = " (nodes differ: the largest count)" if len(counts - {0}) > 1 else ""
        out += [
            f"# From sinfo %G / scontrol show node: GRES {gres} on {where}{mixed}.",
            f"gpus_per_node: {gpus}",
        ]
    types = sorted({t for n in nodes for t in gpu_types(n.gres)} | set(gpu_types(gres)))
    if any(h in t.lower() for t in types for h in AMD_GPU_HINTS):
        out += [
            f"# GPU types {', '.join(types)} look AMD: ROCR_VISIBLE_DEVICES chooses its GPUs.",
            "visible_devices_env: ROCR_VISIBLE_DEVICES",
        ]
    elif types:
        out.append(
            f"# GPU types {', '.join(types)}: CUDA_VISIBLE_DEVICES (the default) selects them."
        )


def _kill_wait(facts: ClusterFacts, out: list[str]) -> None:
    raw = facts.config.get("KillWait", "")
    seconds = raw.split()[0] if raw else ""
    if seconds.isdigit() and int(seconds) > 0:
        out += [
            f"# From scontrol show config: KillWait={raw}. When a job is stopped, Slurm sends "
            f"SIGTERM and {seconds} s later SIGKILL: each engine's stop grace is capped to fit.",
            f"kill_wait_s: {int(seconds)}",
        ]
    else:
        out += [
            f"# ? Slurm's KillWait could not be read ({raw or 'scontrol show config failed'}); "
            "stop graces are capped to it:",
            "# kill_wait_s: 30",
        ]


def _launcher(facts: ClusterFacts, out: list[str]) -> None:
    out.append("# ---- tilert-agent ----")
    if facts.pyxis is True:
        out += [
            f"# pyxis is installed ({facts.pyxis_source}): each engine runs in its image, in a "
            "nested srun step.",
            "launcher: pyxis",
        ]
    elif facts.pyxis is False:
        out += [
            f"# pyxis is not installed ({facts.pyxis_source}): engines run as plain processes "
            "installed on the nodes (docs/launchers.md).",
            "launcher: process",
        ]
    else:
        why = facts.failures.get("srun --help", "unknown")
        out += [
            f"# ? is pyxis installed? (srun --help failed: {why}); pyxis runs engines in images,",
            "# process runs them as installed on the nodes:",
            "# launcher: pyxis",
        ]


def _addresses() -> dict[str, list[ipaddress.IPv4Interface]]:
    stats = psutil.net_if_stats()
    out: dict[str, list[ipaddress.IPv4Interface]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and a.netmask:
                out.setdefault(name, []).append(ipaddress.IPv4Interface(f"{a.address}/{a.netmask}"))
    return out


def _node_ips(facts: ClusterFacts) -> dict[str, ipaddress.IPv4Address]:
    ips = {}
    for node in facts.nodes:
        try:
            ips[node.name] = ipaddress.IPv4Address(socket.gethostbyname(node.address or node.name))
        except (OSError, ValueError):
            continue
    return ips


def choose_interface(
    addresses: Mapping[str, list[ipaddress.IPv4Interface]],
    node_ips: Mapping[str, ipaddress.IPv4Address],
) -> tuple[str | None, str]:
    """The interface on the compute nodes' network (their NodeAddr), and why; else a question."""
    for name, nets in sorted(addresses.items(), key=lambda kv: (not kv[0].startswith("ib"), kv[0])):
        reached = sorted(n for n, ip in node_ips.items() if any(ip in i.network for i in nets))
        if reached:
            shown = ", ".join(reached[:4]) + (" ..." if len(reached) > 4 else "")
            return name, f"{name} is on the network of the compute nodes' NodeAddr ({shown})"
    ib = sorted(n for n in addresses if n.startswith("ib"))
    if ib:
        return None, f"InfiniBand ({', '.join(ib)}) is usually the one to choose"
    return None, "no interface of this login node is on the compute nodes' network"


def _interfaces(facts: ClusterFacts, out: list[str]) -> None:
    addresses = _addresses()
    listed = "; ".join(
        f"{n} {', '.join(str(i) for i in nets)}" for n, nets in sorted(addresses.items())
    )
    out.append(f"# This login node's interfaces (psutil): {listed or 'none up'}.")
    out.append(
        "# Agents advertise the address of this interface on every compute node (the router and "
        "NIXL dial it); the compute nodes must have an interface of that name."
    )
    chosen, why = choose_interface(addresses, _node_ips(facts))
    if chosen is not None:
        out += [f"# Chosen: {why}.", f"network_interface: {_q(chosen)}"]
    else:
        out += [
            f"# ? which interface do the compute nodes talk on? {why}.",
            "# network_interface: ib0",
        ]


QUESTIONS = [
    "# ? images (pyxis): aliases recipes name (roles.*.container), a .sqsh file or registry ref:",
    "# containers:",
    "#   tilert-prefill: /shared/images/tilert-prefill-0.1.6.sqsh",
    "# ? models: aliases for model.path (folders on the compute nodes):",
    "# model_paths:",
    "#   glm5.1-fp8: /shared/models/GLM-5.1-FP8",
    "# ? mounts into every engine's container (host path: container path):",
    "# default_mounts:",
    "#   /shared/models: /models",
    "# ? how compute nodes start the agent, if not as on this node "
    f"({Path(sys.executable).parent / 'tilert-agent'}):",
    "# agent_command: [/shared/venvs/tilert-agent/bin/tilert-agent]",
]


def render(facts: ClusterFacts, *, host: str, when: str) -> str:
    """The commented cluster file for ``facts``."""
    out = [
        f"# Cluster file for tilert-agent, written by `{PROG} init` on {host} at {when}.",
        "# Each value says where it came from; a line starting with `# ?` is a question init could",
        "# not answer: answer it (uncomment the key) or leave it. Keys: docs/recipe.md (cluster",
        f"# file). Use it with --cluster FILE, $TILERT_CLUSTER_FILE, or as ./{CLUSTER_FILE_NAME}.",
        "",
    ]
    part = _partitions(facts, out)
    _time_limit(part, out)
    _account(facts, out)
    _gpus(facts, part, out)
    _kill_wait(facts, out)
    _launcher(facts, out)
    _interfaces(facts, out)
    if facts.failures:
        out.append("# Commands that did not answer:")
        out += [f"#   {cmd}: {why}" for cmd, why in sorted(facts.failures.items())]
    out += QUESTIONS
    return "\n".join(_wrapped(out)) + "\n"


def _wrapped(lines: list[str]) -> list[str]:
    """Comment lines wrapped at 100 columns (a question keeps its ``# ?`` on the first line)."""
    out = []
    for line in lines:
        if not line.startswith("# ") or len(line) <= WIDTH:
            out.append(line)
            continue
        out += textwrap.wrap(
            line[2:], width=WIDTH, initial_indent="# ", subsequent_indent="#   ",
            break_on_hyphens=False, break_long_words=False,
        )  # fmt: skip
    return out


def main(args: argparse.Namespace) -> int:
    """Ask, render, check with the cluster file reader, write (atomically)."""
    problem = output_problem(args.output, force=args.force)
    if problem is not None:
        print(f"{PROG} init: {printable(problem)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{PROG} init: asking Slurm (sinfo, scontrol, srun --help) ...", file=sys.stderr)
    facts = gather(os.environ)
    for command, why in sorted(facts.failures.items()):
        # Their keys become questions; say so here too (is this a login node? is SLURM_CONF set?).
        print(f"{PROG} init: {command}: {printable(' '.join(why.split()))}", file=sys.stderr)
    text = render(facts, host=socket.gethostname(), when=time.strftime("%Y-%m-%d %H:%M %Z"))
    try:
        target = write_output(args.output, text)
    except OSError as exc:
        print(f"{PROG} init: -o {printable(args.output)}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if target is None:
        return EXIT_OK
    try:
        cluster, warnings = read_cluster(target)
    except InputError as exc:  # a bug of init: say so, keep the file to look at
        print(f"{PROG} init: the file written does not read back: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    unknown = sum(1 for line in text.splitlines() if line.startswith("# ?"))
    written = yaml.safe_load(text) or {}
    launcher = written.get("launcher", f"unknown (the default, {cluster.launcher}, applies)")
    partition = written.get("default_partition", "unknown (Slurm's default applies)")
    print(
        f"Wrote {target}: launcher {launcher}, partition {partition}, "
        f"{unknown} questions left (lines starting with `# ?`).",
    )
    if warnings:
        print(render_problems(warnings, str(target)), file=sys.stderr)
    return EXIT_OK
