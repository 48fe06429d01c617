"""``J/sbatch.sh``: the dumb batch script (docs/design.md "The sbatch script stays dumb").

The header comes from the plan (nodes, one task per node, GPUs, ``--exclusive``, account,
partition, time, ``--signal=TERM@<lead>``); the body starts one ``srun`` step per role group,
placed with ``--relative`` so no node list is parsed in shell, each running ``tilert-agent --role R
--job-dir J``; then it waits, and when a step fails it cancels the job. Only the job directory path
and fixed flags reach the shell: every recipe value (name, args, env) is read by the agents from
``J/plan.json``. The few header values that must be written (job name, account, partition, time)
are sanitized or refused, never quoted into shell code.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from agent.job.paths import JobDir
from agent.job.plan import Plan, RolePlan
from agent.problems import InputError, error
from agent.recipe.cluster import ClusterConfig

AGENT_SCRIPT = "tilert-agent"
SBATCH_LOG = "sbatch.out"

_JOB_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
# Account, partition (a comma-separated list) and time (e.g. 1-00:00:00, UNLIMITED) as sbatch
# takes them: anything else could end the #SBATCH line or change how sbatch parses it.
_HEADER_VALUE = re.compile(r"^[A-Za-z0-9._,:+@=-]+$")
# Characters no quoting makes safe in a script line (a newline ends the line; NUL ends the string).
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def default_agent_command(cluster: ClusterConfig | None) -> list[str]:
    """The cluster's ``agent_command``, else the tilert-agent script beside this interpreter."""
    if cluster is not None and cluster.agent_command:
        command = cluster.agent_command
        return shlex.split(command) if isinstance(command, str) else list(command)
    # abspath, not resolve: a venv's python is a symlink and its scripts sit beside the link.
    return [os.path.join(os.path.dirname(os.path.abspath(sys.executable)), AGENT_SCRIPT)]


def agent_command_of(script: str) -> list[str]:
    """The agent command a rendered batch script runs (its ``AGENT=(...)`` line): a job that
    grows the pool runs the same one as the first job. ValueError when there is none."""
    for line in script.splitlines():
        if line.startswith("AGENT=(") and line.endswith(")"):
            return shlex.split(line[len("AGENT=(") : -1])
    raise ValueError("no AGENT=(...) line in the batch script")


def job_name(name: str) -> str:
    """A Slurm job name from the recipe name: [A-Za-z0-9._-] only."""
    return _JOB_NAME_UNSAFE.sub("_", name) or "tilert"


def check_shell_path(value: str, flag: str) -> None:
    """Refuse a path or word with control characters (unsafe in a script even when quoted)."""
    if _CONTROL.search(value):
        raise InputError(
            [
                error(
                    flag,
                    f"{value!r} contains a control character (newline, tab, ...)",
                    "use a path without control characters",
                )
            ]
        )


def _header_value(value: str, key: str) -> str:
    if not _HEADER_VALUE.match(value):
        raise InputError(
            [
                error(
                    key,
                    f"{value!r} is not a value sbatch takes here",
                    "use letters, digits and . _ , : + @ = - only",
                )
            ]
        )
    return value


def _sbatch_quoted(path: str) -> str:
    """A path for an ``#SBATCH`` line: sbatch's own quoting, and ``%`` kept literal."""
    # sbatch expands %j, %N, ... in --output; %% is a literal %. A backslash in the name turns
    # all expansion off (so then % stays as it is).
    if "\\" not in path:
        path = path.replace("%", "%%")
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _literal(line: str) -> list[str]:
    """An assignment of quoted text; shellcheck is told that ``$`` in it is literal on purpose."""
    if "$" in line or "`" in line:
        return ["# shellcheck disable=SC2016  # quoted on purpose: never expanded", line]
    return [line]


def _step(role: RolePlan) -> list[str]:
    """One srun step for a role group (one agent per node)."""
    flags = [
        f"--nodes={role.nodes}",
        f"--ntasks={role.nodes}",
        "--ntasks-per-node=1",
        f"--relative={role.first_node}",
        f"--job-name={role.role}",
        "--export=ALL",
        # A decode agent whose engine failed for good exits non-zero while the others keep
        # serving (degraded): a site default of KillOnBadExit=1 must not end the whole step.
        "--kill-on-bad-exit=0",
    ]
    if role.gpus_per_worker > 0:
        flags.append(f"--gres=gpu:{role.gpus_per_worker}")
    return [
        f"# {role.role}: nodes {role.first_node}..{role.first_node + role.nodes - 1} of the "
        "allocation",
        "srun " + " ".join(flags) + " \\",
        f'  "${{AGENT[@]}}" --role {role.role} --job-dir "$JOB_DIR" &',
    ]


def _checked_root(job: JobDir, agent_command: list[str]) -> str:
    """The job directory as a script may name it, the agent command checked (InputError)."""
    root = str(job.root)
    check_shell_path(root, "--job-dir")
    if not os.path.isabs(root):
        raise ValueError(f"the job directory must be absolute, got {root!r}")
    if not agent_command:
        raise InputError([error("agent_command", "the command is empty", "remove it")])
    for word in agent_command:
        check_shell_path(word, "agent_command")
    return root


def _header(plan: Plan, nodes: int, output: Path) -> list[str]:
    """The ``#SBATCH`` items of a job of ``nodes`` nodes writing its output to ``output``."""
    slurm = plan.slurm
    header = [
        f"--job-name={job_name(plan.name)}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
    ]
    if slurm.gpus_per_node > 0:
        header.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.exclusive:
        header.append("--exclusive")
    for key, flag, value in (
        ("slurm.account", "account", slurm.account),
        ("slurm.partition", "partition", slurm.partition),
        ("slurm.time_limit", "time", slurm.time_limit),
    ):
        if value:
            header.append(f"--{flag}={_header_value(value, key)}")
    header.append(f"--signal=TERM@{int(slurm.signal_lead_s)}")
    header.append(f"--output={_sbatch_quoted(str(output))}")
    return header


def _prologue(plan: Plan, root: str, agent_command: list[str], header: list[str]) -> list[str]:
    """The script up to its steps: header, job directory, agent command, job control."""
    lines = [
        "#!/bin/bash",
        f"# Rendered by tilert-submit for {job_name(plan.name)}. Only the job directory and fixed",
        "# flags are in this script; the agents read everything else from $JOB_DIR/plan.json.",
        *(f"#SBATCH {item}" for item in header),
        "",
        "set -u",
        *_literal(f"JOB_DIR={shlex.quote(root)}"),
        *_literal("AGENT=(" + " ".join(shlex.quote(word) for word in agent_command) + ")"),
        "",
        "# No --cpus-per-task on the steps: a step without it is given every CPU the job holds on",
        "# its nodes (all of them with --exclusive), so process-launched engines inherit them;",
        "# -c would imply --exact and shrink the step. Stale values from the submitting shell",
        "# would do the same.",
        "unset SLURM_CPUS_PER_TASK SRUN_CPUS_PER_TASK SLURM_EXACT",
        "",
    ]
    lines += [
        "# Each step in its own process group (job control): a SIGTERM meant for this shell",
        "# (scancel --full, --batch) must not reach the srun clients, which would abort their",
        "# steps with SIGKILL instead of letting the agents drain.",
        "set -m",
        "pids=()",
        "",
    ]
    return lines


def _wait_steps() -> list[str]:
    """The script's end: wait for every step; the first one that fails cancels the job."""
    return [
        "# From here on SIGTERM is the agents' to handle (tilert-submit stop, the time limit):",
        "# they drain their engines and exit, the steps end, and this shell waits for them.",
        "trap '' TERM",
        "failed=0",
        'while [ "${#pids[@]}" -gt 0 ]; do',
        "  # wait -n wakes when a running step ends; a step that ended before it was called is",
        "  # not reported by it, so every step no longer running is collected by its pid.",
        "  wait -n || true",
        "  running=\" $(jobs -pr | tr '\\n' ' ') \"",
        "  left=()",
        '  for pid in "${pids[@]}"; do',
        '    case "$running" in',
        '      *" $pid "*) left+=("$pid") ;;',
        "      *)",
        "        rc=0",
        '        wait "$pid" || rc=$?',
        '        if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then',
        "          # A step failed (its agents could not run their role): end the job.",
        "          failed=1",
        '          scancel "$SLURM_JOB_ID" || true',
        "        fi",
        "        ;;",
        "    esac",
        "  done",
        "  # (the +-form keeps bash < 4.4 happy under set -u with an empty array)",
        '  pids=(${left[@]+"${left[@]}"})',
        "done",
        'exit "$failed"',
        "",
    ]


def render_sbatch(plan: Plan, job: JobDir, agent_command: list[str]) -> str:
    """The batch script text for ``plan`` in job directory ``job`` (InputError on unsafe input)."""
    root = _checked_root(job, agent_command)
    header = _header(plan, plan.slurm.nodes, Path(root) / "logs" / SBATCH_LOG)
    lines = _prologue(plan, root, agent_command, header)
    # A convert job (tilert-submit convert) has no prefill node.
    for role in (r for r in (plan.prefill, plan.decode) if r.nodes > 0):
        lines += [*_step(role), 'pids+=("$!")', ""]
    return "\n".join(lines + _wait_steps())


def render_grow(
    plan: Plan, job: JobDir, agent_command: list[str], indexes: list[int], first_job: str
) -> str:
    """The batch script of a job growing ``job``'s decode pool (``tilert-submit scale``): one
    decode agent per node with ``--index`` each of ``indexes``, ended when ``first_job`` ends."""
    root = _checked_root(job, agent_command)
    if not first_job.isdigit():
        raise ValueError(f"not a Slurm job id: {first_job!r}")
    tag = "-".join(str(i) for i in indexes)
    header = _header(plan, len(indexes), Path(root) / "logs" / f"sbatch-grow-{tag}.out")
    lines = _prologue(plan, root, agent_command, header)
    lines += [
        f"# This job serves with Slurm job {first_job} and ends with it (stop, time limit,",
        "# failure): its agents then get SIGTERM and drain, as the first job's did.",
        "(",
        f'  while squeue -h -j {first_job} -o %T 2>/dev/null | grep -qv "^COMPLET"; do',
        "    sleep 5",
        "  done",
        '  scancel --signal=TERM "$SLURM_JOB_ID"',
        ") &",
        "",
    ]
    gres = f" --gres=gpu:{plan.decode.gpus_per_worker}" if plan.decode.gpus_per_worker else ""
    for offset, index in enumerate(indexes):
        lines += [
            f"# decode-{index}: node {offset} of this allocation",
            f"srun --nodes=1 --ntasks=1 --relative={offset} --job-name=decode --export=ALL "
            f"--kill-on-bad-exit=0{gres} \\",
            f'  "${{AGENT[@]}}" --role decode --job-dir "$JOB_DIR" --index {index} &',
            'pids+=("$!")',
            "",
        ]
    return "\n".join(lines + _wait_steps())
