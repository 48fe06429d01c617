"""``tilert-submit``: load + validate a recipe, plan, write the job directory, submit (or not).

``tilert-submit RECIPE [--cluster FILE] [--set KEY=VALUE ...] [--dry-run] [--local] [--mock [ROLES]]
[--job-dir DIR]``, ``tilert-submit convert RECIPE [same flags]`` (a one-node job converting the
decode's weights, docs/weights.md), ``tilert-submit migrate RECIPE [-o FILE] [--force]``
(schema 1 to schema 2, docs/recipe.md), and the job commands ``status J [--json]``, ``logs J
[NAME] [-f]``, ``stop J``, ``diagnose J [--json]``, and ``serve RECIPE ...`` (a service of cells
behind one service front, ``submit.serve``).
RECIPE is positional, so the job commands are recognised by the first word; a recipe file with
such a name is given as ``./status``. Bad input exits 2 with a message naming the key or flag,
a runtime failure 1; never a traceback for either.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME
from submit import PROG

# Imported where used, not here: this module is every command's entry, and a job command or
# --help must not pay for what only a submission needs (msgspec and the job's formats, the
# recipe layer: YAML, rules, planner; a backend). `status` imports its own module's needs only,
# --help argparse and agent.recipe.sweep (for --max-jobs' default): docs/performance.md,
# "CLI imports"; tests/test_submit_cli.py checks what `status` and --help import.
if TYPE_CHECKING:
    from agent.job.paths import JobDir
    from agent.job.plan import Plan
    from agent.job.records import JobStatus
    from agent.job.vocab import Process
    from agent.problems import Problem
    from agent.recipe.cluster import ClusterConfig
    from agent.recipe.loader import LoadedRecipe
    from agent.recipe.sweep import Combination
    from submit.backend import Backend, Submitted

JOBS_DIR = "tilert-jobs"

# Job commands: first word -> (module, one-line help). Imported only when used.
JOB_COMMANDS = {
    "status": ("submit.statusview", "show a job's state and its agents"),
    "logs": ("submit.logview", "print (or follow) a job's logs"),
    "stop": ("submit.stop", "stop a job: agents drain, then the job ends"),
    "scale": ("submit.scale", "grow or shrink a serving job's decode pool"),
    "bench": ("submit.bench", "benchmark a ready job from here, show or compare results"),
    "diagnose": ("submit.diagnose", "name what failed in a job: log lines, cause and fix"),
}
# The job commands that take a service directory S (``tilert-submit serve``) as well: its module.
SERVICE_COMMANDS = {
    "status": "submit.servicestatus",
    "logs": "submit.servicelogs",
    "stop": "submit.servicestop",
}
# Commands about the cluster rather than a job: first word -> (module, one-line help).
SETUP_COMMANDS = {
    "init": ("submit.init", "ask Slurm and this node, write a commented cluster file"),
}
# The service (docs/service.md): first word -> (module, one-line help).
SERVE_COMMANDS = {
    "serve": ("submit.serve", "serve a recipe as cells behind one service front"),
}
# ``tilert-submit convert RECIPE ...``: the same flags as a submission, for a convert-only job.
CONVERT_COMMAND = "convert"
# ``tilert-submit migrate RECIPE [-o FILE] [--force]``: a schema-1 recipe written as schema 2.
MIGRATE_COMMAND = "migrate"


def _parser() -> argparse.ArgumentParser:
    from agent.recipe.sweep import MAX_JOBS  # deferred: see the imports' comment

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a model with vLLM prefill + TileRT decode + TileRT's P/D router: "
        "validate the recipe, plan, write the job directory and submit it to Slurm.",
        epilog="Job commands: "
        + "; ".join(f"{PROG} {name} J ... ({text})" for name, (_, text) in JOB_COMMANDS.items())
        + f". A service: {PROG} serve RECIPE [--local] [--service-dir S]"
        + f". Weights ahead of a job: {PROG} {CONVERT_COMMAND} RECIPE ... (a one-node job). "
        + f"A new cluster: {PROG} init [-o FILE] (writes a commented cluster file). "
        f"Schema 1 to schema 2: {PROG} {MIGRATE_COMMAND} RECIPE [-o FILE]. See docs/cli.md.",
    )
    # Optional for argparse only: `--mock RECIPE` (the old spelling) hands the recipe to --mock.
    parser.add_argument("recipe", metavar="RECIPE", nargs="?", help="the recipe YAML file")
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster file (default: $TILERT_CLUSTER_FILE, else ./srtslurm.yaml, else none)",
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="change one recipe value: a dotted path and a YAML value, e.g. "
        "--set roles.decode.nodes=2 (repeatable)",
    )
    parser.add_argument(
        "--unset",
        metavar="KEY",
        action="append",
        default=[],
        dest="unsets",
        help="remove one recipe key (a dotted path), e.g. --unset roles.decode.env.X (repeatable)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, plan, write the job directory and sbatch script, print the plan; "
        "submit nothing",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="run the agents here as local processes instead of through Slurm (foreground)",
    )
    parser.add_argument(
        "--mock",
        nargs="?",
        const="all",
        default=None,
        metavar="ROLES",
        help="replace engines by the project's stand-ins (process launcher): every engine, or "
        "only the ROLES named, comma-separated among prefill, decode, router "
        "(e.g. --mock decode: a real vLLM beside stand-in decodes)",
    )
    parser.add_argument(
        "--job-dir",
        metavar="DIR",
        help=f"job directory; must not exist or be empty (default: ./{JOBS_DIR}/<name>-<time>)",
    )
    parser.add_argument(
        "--max-jobs",
        metavar="N",
        type=_positive,
        default=MAX_JOBS,
        help=f"a sweep may submit at most N jobs (default {MAX_JOBS}); counted before anything "
        "is expanded or written",
    )
    return parser


def _positive(text: str) -> int:
    """``--max-jobs``: a whole number of 1 or more (argparse says which flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def _job_command(name: str, argv: Sequence[str]) -> int:
    module_name, text = {**JOB_COMMANDS, **SETUP_COMMANDS, **SERVE_COMMANDS}[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=text)
    add_arguments = getattr(module, "add_arguments", None)
    if add_arguments is not None:
        add_arguments(parser)
    else:
        parser.add_argument(
            "job_dir",
            metavar="J",
            help="the job directory tilert-submit printed (status, stop: or a service's, S)",
        )
        if name == "status":
            parser.add_argument("--json", action="store_true", help="print status.json as is")
    # Intermixed: `logs J -f decode-0 decode-1` as well as `logs J decode-0 decode-1 -f`.
    args = parser.parse_intermixed_args(list(argv))
    if name in SERVICE_COMMANDS and _is_service(args.job_dir):
        module = importlib.import_module(SERVICE_COMMANDS[name])
    try:
        result: int = module.main(args)
    except BrokenPipeError:
        raise
    except OSError as exc:
        # Backstop: J named something the system refuses (a 300-character component, EACCES).
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{name}: {where}{exc.strerror or exc}")
    return result


def _is_service(path: str) -> bool:
    """Whether ``path`` is a service directory (it holds ``service.json``), not a job's."""
    from agent.service.paths import ServiceDir  # deferred: see the imports' comment

    try:
        return ServiceDir.is_service(Path(path))
    except OSError:
        return False  # the job command says what is wrong with it


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    from agent.problems import printable  # deferred: see the imports' comment

    # Messages quote paths and values the user gave: escaped, so one message stays one line.
    print(f"{PROG}: {printable(message)}", file=sys.stderr)
    return code


def _warn(problems: Sequence[Problem], source: str) -> None:
    from agent.problems import render_problems  # deferred: see the imports' comment

    if problems:
        print(render_problems(problems, source), file=sys.stderr)


def load_cluster(flag: str | None) -> tuple[ClusterConfig | None, list[Problem], str]:
    """The cluster file (--cluster, $TILERT_CLUSTER_FILE, ./srtslurm.yaml), its warnings, its
    name; no cluster when none is found."""
    from agent.recipe.cluster import find_cluster_file, read_cluster

    path = find_cluster_file(flag, os.environ, Path.cwd())
    if path is None:
        return None, [], ""
    cluster, warnings = read_cluster(path)
    return cluster, warnings, str(path)


def _job_root(flag: str | None, name: str) -> Path:
    """The job directory to create: --job-dir as given, or a fresh one under ./tilert-jobs/."""
    from agent.problems import InputError, error  # deferred: see the imports' comment

    if flag is not None:
        root = Path(flag).expanduser().absolute()
        try:
            used = root.exists() and (not root.is_dir() or any(root.iterdir()))
        except OSError as exc:  # a 300-character component, a file in the path, no permission
            raise InputError(
                [
                    error(
                        "--job-dir",
                        f"{flag} cannot be used: {exc.strerror or exc}",
                        "pass a directory path that can be created, or leave --job-dir out",
                    )
                ]
            ) from None
        if used:
            raise InputError(
                [
                    error(
                        "--job-dir",
                        f"{flag} exists and is not an empty directory",
                        "pass a new or empty directory, or leave --job-dir out for a fresh one",
                    )
                ]
            )
        return root
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path.cwd().absolute() / JOBS_DIR / f"{name}-{stamp}"
    root, n = base, 1
    while root.exists():  # two submissions in the same second
        root = base.with_name(f"{base.name}-{n}")
        n += 1
    return root


def pending_status(plan: Plan, job: JobDir) -> JobStatus:
    """``status.json`` at submit: ``pending``, every planned agent listed."""
    import msgspec  # deferred: see the imports' comment

    from agent.job.benchmark import pending_block
    from agent.job.logfiles import log_path
    from agent.job.records import JobAgent, JobStatus

    agents = [
        JobAgent(
            name=f"{role.role}-{i}",
            role=role.role,
            index=i,
            node=None,
            state="pending",
            restarts=0,
            reason="not started",
            log=str(log_path(job, f"{role.role}-{i}", plan=plan)),
            metrics_url=None,
            status_url=None,
        )
        for role in (plan.prefill, plan.decode)
        for i in range(role.nodes)
    ]
    bench = plan.benchmark
    # The router's stand-in is decided on the node (only where the real router cannot run).
    standins: list[str] = [name for name in plan.standins if name != "router"]
    return JobStatus(
        state="pending",
        model=plan.model,
        agents=agents,
        standins=standins,
        benchmark=msgspec.UNSET if isinstance(bench, msgspec.UnsetType) else pending_block(bench),
    )


def write_job(
    job: JobDir, loaded: LoadedRecipe, plan: Plan, script: str, backend: Backend | None = None
) -> None:
    """Lay out the job directory and write recipe.yaml, plan.json, sbatch.sh, status.json
    (``backend``, the one that will run the job, notes what it knows in that first status)."""
    import msgspec  # deferred: see the imports' comment

    from agent.job.atomicfile import write_atomic
    from agent.recipe.loader import resolved_yaml

    job.create()
    write_atomic(job.recipe, resolved_yaml(loaded).encode(), mode=0o644)
    write_atomic(job.plan, msgspec.json.format(msgspec.json.encode(plan)) + b"\n", mode=0o644)
    write_atomic(job.sbatch, script.encode(), mode=0o755)
    status = pending_status(plan, job)
    if backend is not None:
        backend.claim(status)
    job.write_status(status)


@dataclass
class _Prepared:
    """One job ready to be written: its recipe, plan, directory and batch script."""

    loaded: LoadedRecipe
    plan: Plan
    job: JobDir
    agent_command: list[str]
    script: str
    combination: Combination | None = None


def _prepare(
    args: argparse.Namespace,
    cluster: ClusterConfig | None,
    combination: Combination | None,
) -> _Prepared:
    """Load, plan and render one job (InputError when its recipe does not validate)."""
    import msgspec  # deferred: see the imports' comment

    from agent.job.paths import JobDir
    from agent.recipe.convertplan import convert_job_plan
    from agent.recipe.loader import load_recipe
    from agent.recipe.planner import make_plan
    from submit.slurm.render import default_agent_command, render_sbatch

    loaded = load_recipe(
        Path(args.recipe),
        overrides=args.overrides,
        unsets=args.unsets,
        cluster=cluster,
        combination=combination,
    )
    launcher = "process" if args.local else None
    plan = make_plan(loaded, mock=args.mock, launcher=launcher)
    if args.convert:
        plan = convert_job_plan(plan)
    if args.local:
        # Every agent runs on this machine: loopback is the address they all reach.
        plan = msgspec.structs.replace(plan, network_interface="lo")
    job_dir = args.job_dir
    if combination is not None and job_dir:
        job_dir = str(Path(job_dir) / plan.name)  # --job-dir DIR holds a sweep's jobs
    job = JobDir(_job_root(job_dir, plan.name))
    agent_command = default_agent_command(cluster)
    script = render_sbatch(plan, job, agent_command)
    return _Prepared(loaded, plan, job, agent_command, script, combination)


def _prepare_sweep(
    args: argparse.Namespace, cluster: ClusterConfig | None, combinations: list[Combination]
) -> list[_Prepared] | None:
    """Every combination of a sweep, or None after printing each one that does not validate."""
    from agent.problems import InputError  # deferred: see the imports' comment

    prepared, failed = [], 0
    for combination in combinations:
        try:
            prepared.append(_prepare(args, cluster, combination))
        except InputError as exc:
            failed += 1
            print(f"sweep combination {combination.label()}:\n{exc}", file=sys.stderr)
    failed += _collisions(prepared)
    if failed:
        print(
            f"{PROG}: {failed} of {len(combinations)} sweep combinations do not validate; "
            "nothing was submitted",
            file=sys.stderr,
        )
        return None
    return prepared


def _collisions(prepared: list[_Prepared]) -> int:
    """Print each sweep job whose name (or directory) another one has already; how many."""
    from agent.problems import error, render_problems  # deferred: see the imports' comment

    names: dict[str, _Prepared] = {}
    roots: dict[Path, _Prepared] = {}
    count = 0
    for one in prepared:
        label = one.combination.label() if one.combination else ""
        first = names.get(one.plan.name) or roots.get(one.job.root)
        if first is not None:
            count += 1
            other = first.combination.label() if first.combination else ""
            problem = error(
                "sweep",
                f"combinations {other} and {label} are both named {one.plan.name!r} (job names "
                "keep letters, digits, '.', '_' and '-' only)",
                "make the values differ in those characters, or put placeholders in name: that "
                "tell them apart",
            )
            print(render_problems([problem], "sweep"), file=sys.stderr)
        names.setdefault(one.plan.name, one)
        roots.setdefault(one.job.root, one)
    return count


def _prepare_all(
    args: argparse.Namespace,
) -> tuple[list[_Prepared], list[Problem], str] | int:
    """The jobs to write (one per sweep combination) with the cluster file's warnings and name;
    or the exit code after saying why there are none."""
    from agent.problems import InputError  # deferred: see the imports' comment
    from agent.recipe.loader import recipe_sweep
    from agent.recipe.sweep import MAX_JOBS

    try:
        cluster, cluster_warnings, cluster_source = load_cluster(args.cluster)
        combinations = recipe_sweep(
            Path(args.recipe),
            overrides=args.overrides,
            unsets=args.unsets,
            max_jobs=getattr(args, "max_jobs", MAX_JOBS),
        )
        if combinations is not None and args.local:
            return _fail(
                f"--local runs one job in the foreground and this recipe is a sweep of "
                f"{len(combinations)}: run one combination (replace its placeholders with --set "
                "and --unset sweep), or submit the sweep to Slurm"
            )
        if combinations is None:
            return [_prepare(args, cluster, None)], cluster_warnings, cluster_source
        swept = _prepare_sweep(args, cluster, combinations)
        if swept is None:
            return EXIT_BAD_INPUT
        return swept, cluster_warnings, cluster_source
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    """Load, plan, write the job directory (one per sweep combination), then dry-run, run
    locally or submit."""
    from agent.recipe.planner import secret_values  # deferred: see the imports' comment
    from submit.backend import BackendError
    from submit.choice import backend_for

    prepared = _prepare_all(args)
    if isinstance(prepared, int):
        return prepared
    jobs, cluster_warnings, cluster_source = prepared
    backend = None if args.dry_run else backend_for(local=args.local)
    for i, one in enumerate(jobs):
        if one.combination is not None:
            print(f"== sweep job {i + 1} of {len(jobs)}: {one.combination.label()}", flush=True)
        try:
            write_job(one.job, one.loaded, one.plan, one.script, backend)
        except OSError as exc:
            return _fail(
                f"--job-dir {one.job.root}: cannot write the job directory: {exc.strerror or exc}"
            )
        # The first line names the job directory (scripts and people rely on it).
        print(f"Job directory: {one.job.root}", flush=True)
        _warn(cluster_warnings, cluster_source)
        _warn(one.loaded.warnings, one.loaded.source)
        if backend is None:  # the dry run
            from submit.show import render_convert_plan, render_plan

            render = render_convert_plan if args.convert else render_plan
            print(render(one.plan, one.job, one.agent_command, local=args.local))
            continue
        try:
            handle = backend.submit(one.job, one.plan, secret_values(one.loaded.recipe))
        except BackendError as exc:
            submitted = f" ({i} of {len(jobs)} sweep jobs submitted)" if len(jobs) > 1 else ""
            return _fail(f"{exc}{submitted}", EXIT_RUNTIME)
        print(submitted_text(handle))
    if len(jobs) > 1:
        print(f"sweep: {len(jobs)} jobs")
        for one in jobs:
            label = one.combination.label() if one.combination else ""
            print(f"  {one.plan.name}  ({label})  {one.job.root}")
    if args.dry_run:
        print("Dry run: nothing submitted.")
    return EXIT_OK


def submitted_text(handle: Submitted) -> str:
    """What a person reads once a job is submitted: its id and how to follow it."""
    what = (
        f"Slurm job {handle.slurm_job_id}"
        if handle.slurm_job_id
        else f"the local supervisor, pid {handle.local_pid}"
    )
    lines = [f"Submitted {what}", "Follow it with:"]
    for command in ("status", "logs", "stop"):
        extra = " -f" if command == "logs" else ""
        lines.append(f"  {PROG} {command} {shlex.quote(str(handle.job.root))}{extra}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``tilert-submit``."""
    # How to see where it is stuck: kill -USR1 <pid> prints every thread's stack (docs/cli.md).
    # On fd 2 itself: sys.stderr may be a stand-in without a descriptor (a caller's capture).
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        # Ctrl-C anywhere (a long validation, a FIFO read, a submission): one line, the shell's
        # code. Nothing half-written is left: jobs are written only after every check.
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`status J | head -1`): it has what it wanted. Quiet, also for
        # Python's last flush of stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _dispatch(argv: list[str]) -> int:
    """A job command, ``convert RECIPE``, or ``RECIPE``."""
    if argv and any(argv[0] in table for table in (JOB_COMMANDS, SETUP_COMMANDS, SERVE_COMMANDS)):
        return _job_command(argv[0], argv[1:])
    if argv and argv[0] == MIGRATE_COMMAND:
        return _migrate(argv[1:])
    parser = _parser()
    convert = bool(argv) and argv[0] == CONVERT_COMMAND
    if convert:
        parser.prog = f"{PROG} {CONVERT_COMMAND}"
        parser.description = (
            "Convert the recipe's decode weights (roles.decode.convert) into "
            "roles.decode.args.model-weights-dir as a one-node job, ahead of the serving job."
        )
        parser.epilog = "See docs/weights.md."
        argv = argv[1:]
    args = parser.parse_args(argv)
    args.convert = convert
    try:
        args.mock = _standins(args)
    except ValueError as exc:
        parser.error(f"argument --mock: {exc}")
    if args.recipe is None:
        parser.error("the following arguments are required: RECIPE")
    return run(args)


def _migrate(argv: list[str]) -> int:
    from submit import migrate

    parser = argparse.ArgumentParser(
        prog=f"{PROG} {MIGRATE_COMMAND}",
        description="Write a srtctl schema-1 TileRT recipe (backend.type: tilert) as schema 2, "
        "keeping its comments; both plan the same job.",
        epilog="See docs/recipe.md and docs/cli.md.",
    )
    migrate.add_arguments(parser)
    return migrate.main(parser.parse_args(argv))


def _standins(args: argparse.Namespace) -> list[Process]:
    """--mock's roles ([] without --mock); ``--mock RECIPE`` means every role and that recipe."""
    if args.mock is None:
        return []
    from agent.job.plan import parse_standins  # deferred: see the imports' comment

    try:
        return parse_standins(args.mock)
    except ValueError:
        if args.recipe is None and args.mock.strip():
            args.recipe = args.mock
            return parse_standins("all")
        raise


if __name__ == "__main__":
    sys.exit(main())
