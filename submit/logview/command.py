"""``tilert-submit logs J [NAME...] [-f] [--agent] [--tail N] [--since T] [-t] [--no-color]``.

Like ``docker compose logs``: every source (prefill-0, decode-0.., router, benchmark) with a
``name | `` prefix, one source after the other in file order (the engines' lines carry no common
timestamp to merge on). History includes the rotated files (oldest first) unless ``--tail`` is
given. ``-f`` then follows every source at once and ends when the job does (``follow``). Without
``-f`` the files in the job directory are read right here, without trio, so the command starts
fast; node-local logs are read through the agents (``remote``). docs/logs.md has every option
next to its kubectl and compose equivalent.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from agent.errors import EXIT_BAD_INPUT
from agent.job.logtail import history, open_log
from agent.job.paths import JobDir
from submit.logview.catalogue import (
    Catalogue,
    Selection,
    SelectionError,
    missing_log,
    read_plan,
)
from submit.logview.options import Options
from submit.logview.printer import Printer, say, wants_colour

# Go's durations, as kubectl and compose take them: 10m, 1h30m, 1.5h, 45s, 500ms (and days).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``logs`` subcommand's arguments to ``parser``."""
    parser.add_argument(
        "job_dir",
        metavar="J",
        help="the job directory tilert-submit printed, or a service's (S: then NAME is "
        "CELL [NAME...], docs/service.md)",
    )
    parser.add_argument(
        "name",
        metavar="NAME",
        nargs="*",
        help="sources to show: prefill-0, decode-N, router, benchmark, or a shell pattern such "
        "as 'decode-*' (default: all)",
    )
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new lines until the job ends (exit 0 stopped, 1 failed; with NAMEs "
        "until they end) or Ctrl-C (exit 0)",
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
    parser.add_argument(
        "--since",
        metavar="T",
        default=None,
        help="only lines received since T: a duration ago (10m, 1h30m, 45s, 2d) or an ISO 8601 "
        "time (2026-12-02T11:22:33Z; without a zone it is local time)",
    )
    parser.add_argument(
        "-t",
        "--timestamps",
        action="store_true",
        help="show the time each line was received (ISO 8601, UTC) after the name",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="no colours (they are only used on a terminal anyway, and never with NO_COLOR set)",
    )


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: ``10m``/``1h30m`` ago, or an ISO 8601 time; Unix seconds (``ValueError``)."""
    text = text.strip()
    now = time.time() if now is None else now
    if _DURATION.fullmatch(text):
        return now - sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither a duration (10m, 1h30m, 45s) nor an ISO 8601 time "
            "(2026-12-02T11:22:33Z)"
        ) from None
    return when.timestamp() if when.tzinfo else when.astimezone().timestamp()


def _fail(message: str) -> int:
    """Print a user-facing error; exit code 2."""
    say(message)
    return EXIT_BAD_INPUT


def _print_local(selection: Selection, options: Options, printer: Printer) -> int:
    """Print the history of every chosen source in the job directory, one after the other."""
    sources = selection.sources()
    if not sources:
        say(f"no logs yet in {selection.catalogue.job.logs} (no agent has started)")
    for source in sources:
        if not source.path.exists():
            say(missing_log(source, follow=False))
            continue
        follower = open_log(
            source.path, tail_lines=options.tail, since=options.since, timestamps=options.timestamps
        )
        for batch in history(follower, rotated=options.rotated):
            printer.emit(source.name, batch)
        printer.emit(source.name, follower.finish())
    return 0


def _options(args: argparse.Namespace) -> Options:
    """The reading options from the parsed arguments (``ValueError`` for a bad one)."""
    tail = getattr(args, "tail", None)
    if tail is not None and tail < 0:
        raise ValueError("--tail must be 0 or more")
    since_text = getattr(args, "since", None)
    return Options(
        follow=bool(getattr(args, "follow", False)),
        agent=bool(getattr(args, "agent", False)),
        tail=tail,
        since=parse_since(since_text) if since_text is not None else None,
        timestamps=bool(getattr(args, "timestamps", False)),
    )


def _access(job: JobDir, options: Options, catalogue: Catalogue) -> str:
    """The job's bearer token when its logs are read through the agents (else ""); ValueError
    saying why the logs cannot be read as asked (``-f`` of a job never submitted, no token)."""
    if options.follow:
        from submit.logview.jobend import never_submitted

        unsubmitted = never_submitted(job)
        if unsubmitted is not None:
            raise ValueError(unsubmitted)
    if not catalogue.node_local:
        return ""
    try:
        return job.read_token()
    except OSError as exc:
        raise ValueError(
            f"engine logs are on the nodes (agent.logs.location: node) and are read through "
            f"the agents, which needs {job.token}: {exc.strerror or exc}"
        ) from None


def main(args: argparse.Namespace) -> int:
    """Run ``tilert-submit logs``: 0 when read (or the followed job stopped), 1 when the followed
    job failed or an agent could not be reached, 2 for a bad J, NAME or option, 130 on Ctrl-C
    without ``-f``."""
    job = JobDir(Path(args.job_dir))
    if not job.root.is_dir():
        return _fail(f"{job.root} does not exist; pass the job directory tilert-submit printed")
    if not job.logs.is_dir():
        return _fail(
            f"{job.root} is not a job directory (it has no logs/ folder); "
            "pass the directory tilert-submit printed first"
        )
    try:
        options = _options(args)
    except ValueError as exc:
        return _fail(str(exc))
    words = getattr(args, "name", None) or []
    if isinstance(words, str):
        words = [words]
    catalogue = Catalogue(job, read_plan(job), agent=options.agent)
    try:
        selection = Selection(list(words), catalogue)
    except SelectionError as exc:
        return _fail(str(exc))
    try:
        token = _access(job, options, catalogue)
    except ValueError as exc:
        return _fail(str(exc))
    out = sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")
    colour = wants_colour(out, no_color=bool(getattr(args, "no_color", False)), env=os.environ)
    # Padded to the longest name shown: every known one, or only the ones asked for.
    names = catalogue.known() if selection.everything else selection.names()
    printer = Printer(out, names, colour=colour, timestamps=options.timestamps)
    code = 0
    try:
        if not options.follow and not catalogue.node_local:
            try:
                code = _print_local(selection, options, printer)
            except KeyboardInterrupt:
                code = 130  # Ctrl-C while printing: the shell's convention, without a traceback
        else:
            code = _run_session(job, selection, options, printer, token)
    except* BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python's final flush quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    return code


def _run_session(
    job: JobDir, selection: Selection, options: Options, printer: Printer, token: str
) -> int:
    """Follow (or read node-local logs) under trio; imported only here, so --help stays fast."""
    import trio

    from submit.logview.follow import Session

    code = 0
    try:
        code = trio.run(Session(job, selection, options, printer, token).run)
    except* KeyboardInterrupt:
        # Ctrl-C before the signal handler was installed: a normal end of -f too.
        code = 0 if options.follow else 130
    return code
