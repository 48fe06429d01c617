"""``tilert-submit serve RECIPE [--cluster F] [--local] [--mock [ROLES]] [--service-dir S]
[--set K=V ...] [--unset K ...] [--dry-run]``: a service of cells behind one service front
(docs/service.md).

The command is the service front: it holds ``S/front.lock`` (a second front on ``S`` refuses,
naming the holder), serves clients at ``service.front.host:port`` (or on the socket systemd
passed, ``agent.service.listen``) through ``agent.service.front.ServiceFront``, and keeps its
cells with ``agent.service.keeper.CellKeeper`` (launchers: ``submit.servecells``). It tells
systemd READY once a cell serves.

Signals (docs/service.md, "Signals"): SIGTERM or SIGINT stops the service: every cell drains and
stops, then the front exits 0. SIGKILL leaves the cells running; ``serve`` again on the same
``S`` adopts them and submits nothing twice.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME
from submit import PROG

if TYPE_CHECKING:
    from agent.node.folderlock import HeldLock
    from agent.recipe.loader import LoadedRecipe
    from agent.recipe.serviceplan import ServicePlan
    from agent.service.keeper import CellKeeper
    from agent.service.paths import ServiceDir

SERVICES_DIR = "tilert-services"
# How often the front looks whether a cell serves yet (for systemd's READY and STATUS).
NOTIFY_EVERY_S = 1.0

log = logging.getLogger("tilert.service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags (the recipe flags of a submission, plus the service directory)."""
    parser.description = (
        "Serve the recipe's model as a service: service.cells cells (each an ordinary job) "
        "behind one service front whose address outlives every cell; successors before each "
        "cell's time limit, failed cells replaced. See docs/service.md."
    )
    parser.add_argument("recipe", metavar="RECIPE", help="the recipe YAML file")
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (as for a submission)")
    parser.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
        help="change one recipe value (repeatable), as for a submission",
    )  # fmt: skip
    parser.add_argument(
        "--unset", metavar="KEY", action="append", default=[], dest="unsets",
        help="remove one recipe key (repeatable), as for a submission",
    )  # fmt: skip
    parser.add_argument(
        "--local", action="store_true",
        help="run the cells here as local processes (each outlives the front) instead of Slurm",
    )  # fmt: skip
    parser.add_argument(
        "--mock", nargs="?", const="all", default=None, metavar="ROLES",
        help="the cells' engines are the project's stand-ins (every role, or the ROLES named)",
    )  # fmt: skip
    parser.add_argument(
        "--service-dir", metavar="S",
        help=f"the service directory (default ./{SERVICES_DIR}/<name>); serving an existing one "
        "adopts its running cells",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="validate, print the service plan and one cell's plan; start nothing",
    )  # fmt: skip


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    from agent.problems import printable

    print(f"{PROG} serve: {printable(message)}", file=sys.stderr)
    return code


def cell_args(args: argparse.Namespace) -> list[str]:
    """The flags each cell is submitted with: the recipe (absolute) and ``serve``'s own."""
    out = [str(Path(args.recipe).absolute())]
    if args.cluster:
        out += ["--cluster", str(Path(args.cluster).absolute())]
    for value in args.overrides:
        out += ["--set", value]
    for value in args.unsets:
        out += ["--unset", value]
    if args.mock is not None:
        out += ["--mock", args.mock]
    return out


def _load(args: argparse.Namespace) -> tuple[LoadedRecipe, ServicePlan, Any]:
    """The recipe, its service plan and one cell's plan (InputError when any does not hold)."""
    import msgspec

    from agent.job.plan import parse_standins
    from agent.problems import InputError, error
    from agent.recipe.loader import load_recipe
    from agent.recipe.planner import make_plan
    from agent.recipe.rules.service import serving
    from agent.recipe.serviceplan import service_plan
    from submit.cli import load_cluster

    try:
        mock = parse_standins(args.mock) if args.mock is not None else []
    except ValueError as exc:
        fix = "name roles among prefill, decode, router"
        raise InputError([error("--mock", str(exc), fix)]) from None
    cluster, _, _ = load_cluster(args.cluster)
    loaded = load_recipe(
        Path(args.recipe), overrides=args.overrides, unsets=args.unsets, cluster=cluster
    )
    try:
        splan = service_plan(loaded.recipe)
    except InputError as exc:  # named after the recipe file, as the loader's own problems are
        raise InputError(exc.problems, loaded.source) from None
    plan = make_plan(loaded, mock=mock, launcher="process" if args.local else None)
    if args.local:
        plan = msgspec.structs.replace(plan, network_interface="lo")
    problems = serving(loaded.recipe, signal_lead_s=plan.slurm.signal_lead_s)
    if problems:
        raise InputError(problems, loaded.source)
    return loaded, splan, plan


def _service_dir(args: argparse.Namespace, name: str) -> ServiceDir:
    from agent.service.paths import ServiceDir

    if args.service_dir:
        return ServiceDir(Path(args.service_dir).expanduser().absolute())
    return ServiceDir(Path.cwd().absolute() / SERVICES_DIR / name)


def render_service_plan(splan: ServicePlan, sdir: ServiceDir) -> str:
    """The dry run's lines about the service itself (the cell's plan follows them)."""
    lead = "auto" if splan.successor_lead_s is None else f"{splan.successor_lead_s:g} s"
    limit = "none" if splan.time_limit_s is None else f"{splan.time_limit_s:g} s"
    return "\n".join(
        [
            f"Service directory: {sdir.root}",
            f"  service front: http://{splan.host}:{splan.port}",
            f"  cells: {splan.cells} (at most {splan.max_cells} at once during a succession)",
            f"  cells' time limit: {limit}; successor lead: {lead}; drain: {splan.drain_s:g} s",
            f"  replacements: backoff {splan.replace_backoff_s:g} s doubling to "
            f"{splan.replace_backoff_max_s:g} s, at most {splan.replace_max_per_hour} per hour",
            "Each cell's job (cell-1 shown):",
        ]
    )


def hold_lock(sdir: ServiceDir) -> HeldLock | str:
    """``S/front.lock`` held by this process, or why not (another front holds it). A lock left
    by a front on this host whose pid is gone (SIGKILLed) is taken over."""
    from agent.node.folderlock import LockInfo, observe, take_over, try_acquire
    from submit.local.backend import pid_alive

    host = socket.gethostname()
    info = LockInfo(
        token=str(os.getpid()), agent="service-front", node=host, job=str(sdir.root),
        pid=os.getpid(), temp="", started_at=time.time(),
    )  # fmt: skip
    for _ in range(3):
        held = try_acquire(sdir.lock, info)
        if held is not None:
            return held
        seen = observe(sdir.lock)
        if seen is None:
            continue
        holder = seen.info
        if holder is not None and holder.node == host and not pid_alive(holder.pid):
            log.info("taking over %s: its front (pid %d) is gone", sdir.lock, holder.pid)
            take_over(sdir.lock, seen)
            continue
        who = f"pid {holder.pid} on {holder.node}" if holder else "an unreadable holder"
        return (
            f"another service front ({who}) serves {sdir.root}: stop it with `{PROG} stop "
            f"{sdir.root}` (or signal that pid); if it is gone, remove {sdir.lock}"
        )
    return f"{sdir.lock} changed hands while this front tried to take it; try again"


def _setup_log(sdir: ServiceDir) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    for handler in (logging.FileHandler(sdir.log), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(fmt)
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(args: argparse.Namespace) -> int:
    """Validate, then serve until a signal stops the service (the module docstring)."""
    from agent.job.paths import JobDir
    from agent.problems import InputError
    from agent.recipe.loader import resolved_yaml
    from submit.show import render_plan
    from submit.slurm.render import default_agent_command

    try:
        loaded, splan, plan = _load(args)
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    sdir = _service_dir(args, plan.name)
    if args.dry_run:
        print(render_service_plan(splan, sdir))
        command = default_agent_command(None)
        print(render_plan(plan, JobDir(sdir.cells / "cell-1"), command, local=args.local))
        print("Dry run: nothing started.")
        return EXIT_OK
    try:
        sdir.cells.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"--service-dir {sdir.root}: cannot be made: {exc.strerror or exc}")
    lock = hold_lock(sdir)
    if isinstance(lock, str):
        return _fail(lock, EXIT_RUNTIME)
    try:
        from agent.job.atomicfile import write_atomic

        write_atomic(sdir.recipe, resolved_yaml(loaded).encode())
        _setup_log(sdir)
        print(f"Service directory: {sdir.root}", flush=True)
        return _run(args, sdir, splan, plan)
    finally:
        lock.release()


def _run(args: argparse.Namespace, sdir: ServiceDir, splan: ServicePlan, plan: Any) -> int:
    import trio

    from agent.node.sdnotify import Notifier
    from agent.problems import InputError
    from agent.service.listen import address, inherited_socket
    from agent.web.server import bound_socket
    from submit.local.timelimit import time_limit_s
    from submit.servecells import launcher_for

    # Taken out of the environment before any cell starts: no cell may speak for the front.
    notifier = Notifier.from_environ(log)
    try:
        inherited = inherited_socket()
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    if inherited is not None:
        sock, (host, port) = inherited, address(inherited)
    else:
        host, port = splan.host, splan.port
        try:
            sock = bound_socket(host, port)
        except OSError as exc:
            return _fail(
                f"service.front: cannot listen on {host}:{port}: {exc.strerror or exc} (set "
                "service.front.port to a free port, or stop what listens there)",
                EXIT_RUNTIME,
            )
    # As the local supervisor keeps it (whole minutes, submit.local.timelimit).
    one_host = plan.network_interface == "lo"
    launcher = launcher_for(args.local, cell_args(args), time_limit_s(plan), one_host=one_host)
    where = Where(host, port, sock)
    trio.run(_serve, sdir, splan, launcher, plan, where, notifier)
    return EXIT_OK


@dataclass(frozen=True)
class Where:
    """Where the service front listens."""

    host: str
    port: int
    sock: socket.socket


async def _serve(
    sdir: ServiceDir,
    splan: ServicePlan,
    launcher: Any,
    plan: Any,
    where: Where,
    notifier: Any,
) -> None:
    """The front and the keeper in one nursery until SIGTERM/SIGINT (then stop every cell)."""
    import psutil
    import trio

    from agent.service.figures import ServiceFigures
    from agent.service.front import ServiceFront
    from agent.service.keeper import CellKeeper

    figures = ServiceFigures()
    # The cells' own front door policy (agent.front: its queue's bounds, its retries).
    front = ServiceFront(plan.agent.front, figures)
    url = f"http://{where.host}:{where.port}"
    keeper = CellKeeper(sdir, splan, launcher, front, figures, name=plan.name, front_url=url)
    keeper.set_front(
        pid=os.getpid(), started_at=psutil.Process().create_time(), host=socket.gethostname()
    )
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run, where.sock)
            await nursery.start(keeper.run)
            log.info("service front at %s; cells in %s", url, sdir.cells)
            nursery.start_soon(_tell_systemd, keeper, front, notifier)
            async for signum in signals:
                log.info(
                    "%s: stopping the service (every cell drains)", signal.Signals(signum).name
                )
                break
            await _stop(keeper)
            nursery.cancel_scope.cancel()


async def _stop(keeper: CellKeeper) -> None:
    import trio

    with trio.CancelScope(shield=True):
        await keeper.stop()


async def _tell_systemd(keeper: CellKeeper, front: Any, notifier: Any) -> None:
    """READY=1 once a cell serves; STATUS= the cells on every look."""
    import trio

    ready = False
    while notifier.enabled:
        serving = front.serving()
        states = ", ".join(f"{c.name} {c.state}" for c in keeper.cells if c.state != "ended")
        fields = {"STATUS": f"{keeper.state}: {states or 'no cell yet'}"}
        if serving and not ready:
            fields["READY"] = "1"
            ready = True
        notifier.send(**fields)
        await trio.sleep(NOTIFY_EVERY_S)
    with contextlib.suppress(Exception):
        notifier.close()
