"""``tilert-submit logs J [NAME] [-f] [--agent] [--tail N]``: a job's log files with name prefixes.

Like ``docker compose logs``: every source (prefill-0, decode-0.., router) with a ``name | ``
prefix, one source after the other in file order (the engines' lines carry no common timestamp to
merge on); ``-f`` then follows all of them at once, picks up sources whose agent starts later, and
ends on Ctrl-C with exit 0. History includes the rotated files (oldest first) unless ``--tail``
is given.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

import msgspec
import trio

from agent.job.logfiles import log_files, log_path, rotated_files
from agent.job.logtail import LogFollower
from agent.job.names import ROUTER_NAME, agent_name
from agent.job.paths import JobDir
from agent.job.plan import load_plan

# docker compose's palette: bright cyan, yellow, green, magenta, blue, then the plain ones.
_COLOURS = ("96", "93", "92", "95", "94", "36", "33", "32", "35", "34")
_RESCAN_S = 1.0
_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``logs`` subcommand's arguments to ``parser``."""
    parser.add_argument("job_dir", metavar="J", help="the job directory tilert-submit printed")
    parser.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        default=None,
        help="one source: prefill-0, decode-N or router (default: all)",
    )
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C"
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="show the agents' own agent.log instead of the engines' logs",
    )
    parser.add_argument(
        "--tail",
        metavar="N",
        type=int,
        default=None,
        help="start from the last N lines of each current file (default: everything)",
    )


class _Printer:
    """Writes prefixed lines and flushes after each batch, so ``| grep`` sees them at once."""

    def __init__(self, out: TextIO, names: Iterable[str], colour: bool) -> None:
        self.out = out
        self.order = list(names)
        self.width = max((len(n) for n in self.order), default=0)
        self.colour = colour

    def prefix(self, name: str) -> str:
        """``name | `` padded to the longest name, coloured on a terminal."""
        if name not in self.order:
            self.order.append(name)
        text = f"{name:<{self.width}} |"
        if not self.colour:
            return text + " "
        code = _COLOURS[self.order.index(name) % len(_COLOURS)]
        return f"\033[{code}m{text}\033[0m "

    def emit(self, name: str, lines: Iterable[str]) -> None:
        """Print ``lines`` of source ``name``."""
        prefix = self.prefix(name)
        self.out.write("".join(f"{prefix}{line}\n" for line in lines))
        self.out.flush()


def _say(message: str) -> None:
    """A message for the user on stderr (stdout carries only log lines)."""
    print(f"tilert-submit logs: {message}", file=sys.stderr)


def _fail(message: str) -> int:
    """Print a user-facing error; exit code 2."""
    _say(message)
    return 2


def _planned_names(job: JobDir, agent: bool) -> list[str]:
    """The names the plan says this job has (empty when plan.json is missing or unreadable)."""
    try:
        plan = load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError):
        return []
    names = [agent_name("prefill", i) for i in range(plan.prefill.nodes)]
    names += [agent_name("decode", i) for i in range(plan.decode.nodes)]
    return names if agent else [*names, ROUTER_NAME]


def _known(job: JobDir, agent: bool) -> list[str]:
    """Planned names, then any other source found on disk, in display order."""
    names = _planned_names(job, agent)
    return names + [n for n in log_files(job, agent=agent) if n not in names]


_HISTORY_BATCH = 4096


def _history(follower: LogFollower, path: Path, tail: bool) -> Iterator[list[str]]:
    """Batches of the rotated files (oldest first, unless tailing), then the current file so far."""
    sources = [] if tail else [LogFollower(old) for old in rotated_files(path)]
    for source in [*sources, follower]:
        batch: list[str] = []
        for line in source.drain():
            batch.append(line)
            if len(batch) >= _HISTORY_BATCH:
                yield batch
                batch = []
        if source is not follower:
            batch += source.finish()
        yield batch


def _print_all(
    job: JobDir, names: list[str] | None, agent: bool, tail: int | None, p: _Printer
) -> int:
    """Print the history of every source (or the chosen ones), one after the other."""
    files = log_files(job, agent=agent)
    chosen = names if names is not None else list(files)
    if not chosen:
        _say(f"no logs yet in {job.logs} (no agent has started)")
    for name in chosen:
        path = files.get(name) or log_path(job, name, agent=agent)
        if not path.exists():
            _say(f"{name}: no log yet ({path} does not exist)")
            continue
        follower = LogFollower(path, tail_lines=tail)
        for batch in _history(follower, path, tail is not None):
            p.emit(name, batch)
        p.emit(name, follower.finish())
    return 0


async def _follow(
    job: JobDir, names: list[str] | None, agent: bool, tail: int | None, p: _Printer
) -> None:
    """History of each source in turn, then every source concurrently; late sources join."""
    stop = trio.Event()

    async def on_signal(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for _ in signals:
                stop.set()
                return

    async def follow_rest(name: str, follower: LogFollower) -> None:
        async for batch in follower.batches(poll_s=_POLL_S, stop=stop):
            p.emit(name, batch)

    async with trio.open_nursery() as nursery:
        await nursery.start(on_signal)
        started: set[str] = set()
        while not stop.is_set():
            if names is not None:
                current = {n: log_path(job, n, agent=agent) for n in names}
            else:
                current = log_files(job, agent=agent)
            for name, path in current.items():
                if name in started or stop.is_set():
                    continue
                started.add(name)
                follower = LogFollower(path, tail_lines=tail)
                if path.exists():
                    # Histories one after the other, in name order; Ctrl-C works in between.
                    for batch in _history(follower, path, tail is not None):
                        p.emit(name, batch)
                        await trio.lowlevel.checkpoint()
                        if stop.is_set():
                            break
                nursery.start_soon(follow_rest, name, follower)
            with trio.move_on_after(_RESCAN_S):
                await stop.wait()
        nursery.cancel_scope.deadline = trio.current_time() + 5  # followers end on stop


def main(args: argparse.Namespace) -> int:
    """Run ``tilert-submit logs``; 0 when the job could be read, 2 for a bad J or NAME."""
    job = JobDir(Path(args.job_dir))
    agent = bool(getattr(args, "agent", False))
    tail = getattr(args, "tail", None)
    if not job.root.is_dir():
        return _fail(f"{job.root} does not exist; pass the job directory tilert-submit printed")
    if not job.logs.is_dir():
        return _fail(
            f"{job.root} is not a job directory (it has no logs/ folder); "
            "pass the directory tilert-submit printed first"
        )
    if tail is not None and tail < 0:
        return _fail("--tail must be 0 or more")
    names: list[str] | None = None
    known = _known(job, agent)
    if args.name is not None:
        if args.name not in known:
            which = ", ".join(known) or "none yet"
            hint = " (the router has no agent.log: see prefill-0)" if agent else ""
            return _fail(f"unknown NAME {args.name!r}{hint}; this job has: {which}")
        names = [args.name]
    out = sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")
    printer = _Printer(out, names or known, colour=out.isatty())
    try:
        if not args.follow:
            try:
                return _print_all(job, names, agent, tail, printer)
            except KeyboardInterrupt:
                return 130  # Ctrl-C while printing: the shell's convention, without a traceback
        try:
            trio.run(_follow, job, names, agent, tail, printer)
        except* KeyboardInterrupt:
            pass  # Ctrl-C before the signal handler was installed: a normal end too
        return 0
    except* BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python's final flush quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tilert-submit logs")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
