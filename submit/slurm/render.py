"""``J/sbatch.sh``: the dumb batch script (docs/design.md "The sbatch script stays dumb").

The header comes from the plan (nodes, one task per node, GPUs, ``--exclusive``, account,
partition, time, ``--signal=TERM@<lead>``); the body starts one ``srun`` step per role group,
placed with ``--relative`` so no node list is parsed in shell, each running ``tilert-agent --role R
--job-dir J``; then it waits, and when a step fails it cancels the job. Only the job directory path
and fixed flags reach the shell: every recipe value (name, args, env) is read by the agents from
``J/plan.json``. The few header values that must be written (job name, account, partition, time)
are sanitized or refused, never quoted into shell code. The static part of the script is
``sbatch.sh.tmpl`` beside this module (bash that shellcheck reads as it is); the rendered header,
variables and steps replace its marker lines.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from importlib import resources
from pathlib import Path

from agent.job.paths import JobDir
from agent.job.plan import Plan, RolePlan
from agent.problems import InputError, error
from agent.recipe.cluster import ClusterConfig

AGENT_SCRIPT = "tilert-agent"
SBATCH_LOG = "sbatch.out"
# The static part of the script, and the marker lines where the rendered parts go (whole lines,
# comments to bash, so shellcheck reads the template as the script it becomes).
TEMPLATE = "sbatch.sh.tmpl"
HEADER_MARK = "#@SBATCH_HEADER@"
VARIABLES_MARK = "#@VARIABLES@"
STEPS_MARK = "#@STEPS@"
JOB_NAME_MARK = "@JOB_NAME@"

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


def _check_inputs(root: str, agent_command: list[str]) -> None:
    """Refuse a job directory or agent command that cannot be written into the script."""
    check_shell_path(root, "--job-dir")
    if not os.path.isabs(root):
        raise ValueError(f"the job directory must be absolute, got {root!r}")
    if not agent_command:
        raise InputError([error("agent_command", "the command is empty", "remove it")])
    for word in agent_command:
        check_shell_path(word, "agent_command")


def _header(plan: Plan, root: str) -> list[str]:
    """The ``#SBATCH`` lines: the allocation, the signal lead and where sbatch writes."""
    slurm = plan.slurm
    header = [
        f"--job-name={job_name(plan.name)}",
        f"--nodes={slurm.nodes}",
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
    header.append(f"--output={_sbatch_quoted(str(Path(root) / 'logs' / SBATCH_LOG))}")
    return [f"#SBATCH {item}" for item in header]


def _variables(root: str, agent_command: list[str]) -> list[str]:
    """``JOB_DIR`` and ``AGENT``: the only values of the submission the script holds."""
    return [
        *_literal(f"JOB_DIR={shlex.quote(root)}"),
        *_literal("AGENT=(" + " ".join(shlex.quote(word) for word in agent_command) + ")"),
    ]


def _steps(plan: Plan) -> list[str]:
    """One backgrounded srun step per role group, each pid kept for the wait loop."""
    lines: list[str] = []
    # A convert job (tilert-submit convert) has no prefill node.
    for role in (r for r in (plan.prefill, plan.decode) if r.nodes > 0):
        lines += [*_step(role), 'pids+=("$!")', ""]
    return lines


def sbatch_template() -> str:
    """The script's static part (``sbatch.sh.tmpl`` beside this module, shipped with it)."""
    return resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")


def render_sbatch(plan: Plan, job: JobDir, agent_command: list[str]) -> str:
    """The batch script text for ``plan`` in job directory ``job`` (InputError on unsafe input)."""
    root = str(job.root)
    _check_inputs(root, agent_command)
    sections = {
        HEADER_MARK: _header(plan, root),
        VARIABLES_MARK: _variables(root, agent_command),
        STEPS_MARK: _steps(plan),
    }
    lines: list[str] = []
    # The job name goes into template lines only: a generated line (the job directory) may hold
    # any text, the marker's included.
    for line in sbatch_template().split("\n"):
        lines += sections.get(line, [line.replace(JOB_NAME_MARK, job_name(plan.name))])
    return "\n".join(lines)
