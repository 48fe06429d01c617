"""``tilert-submit logs S [CELL [NAME...]] [options]``: a service's logs.

``logs S``: the service front's own log (``S/service.log``: submissions, successions,
replacements, adoptions); ``--tail N`` its last N lines; ``-f`` follows it until the service has
stopped (or failed) and its front is gone, or Ctrl-C. ``logs S CELL [NAME...]``: cell CELL's logs,
exactly as ``logs J [NAME...]`` shows a job's (every option applies: ``-f``, ``--agent``,
``--tail``, ``--since``, ...).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO

from agent.errors import EXIT_BAD_INPUT, EXIT_OK
from agent.problems import printable
from agent.service.paths import ServiceDir
from submit.servicestatus import front_alive, read_service

# How often ``logs S -f`` looks for new lines and whether the service has ended.
FOLLOW_POLL_S = 0.5
ENDED = frozenset({"stopped", "failed"})


def _fail(message: str) -> int:
    print(printable(f"tilert-submit: {message}"), file=sys.stderr)
    return EXIT_BAD_INPUT


def _ended(service: ServiceDir) -> bool:
    """The service has stopped or failed and its front is gone: nothing more will be written."""
    status = read_service(service)
    return status.state in ENDED and front_alive(status) is not True


def _print_lines(source: IO[str], tail: int | None) -> None:
    lines: deque[str] | list[str] = deque(source, maxlen=tail) if tail else list(source)
    for line in lines:
        sys.stdout.write(line)
    sys.stdout.flush()


def front_log(service: ServiceDir, tail: int | None, follow: bool) -> int:
    """Print the service front's log (its last ``tail`` lines); with ``follow``, its new lines
    until the service has ended or Ctrl-C."""
    if not service.log.is_file() and not follow:
        print(f"{service.log}: no log yet (the service front writes it once it runs)")
        return EXIT_OK
    while not service.log.is_file():
        if _ended(service):
            return EXIT_OK
        time.sleep(FOLLOW_POLL_S)
    with open(service.log, encoding="utf-8", errors="replace") as source:
        _print_lines(source, tail)
        while follow:
            line = source.readline()
            if line:
                sys.stdout.write(line)
                continue
            sys.stdout.flush()
            if _ended(service):
                _print_lines(source, None)
                break
            time.sleep(FOLLOW_POLL_S)
    return EXIT_OK


def main(args: argparse.Namespace) -> int:
    """``logs S`` (the front's log) or ``logs S CELL [NAME...]`` (the cell's, as ``logs J``)."""
    service = ServiceDir(Path(args.job_dir))
    status = read_service(service)
    words = list(getattr(args, "name", None) or [])
    if not words:
        try:
            return front_log(service, args.tail, bool(args.follow))
        except KeyboardInterrupt:
            return EXIT_OK
    cell, names = words[0], words[1:]
    known = sorted({c.name for c in status.cells} | _cell_names(service))
    if cell not in known:
        return _fail(
            f"{service.root} has no cell {cell!r}; its cells: {', '.join(known) or 'none yet'} "
            "(logs S CELL [NAME...]: the cell first, then its sources)"
        )
    from submit.logview import command

    cell_args = argparse.Namespace(**{**vars(args), "job_dir": str(service.cell(cell).root)})
    cell_args.name = names
    return command.main(cell_args)


def _cell_names(service: ServiceDir) -> set[str]:
    try:
        return {p.name for p in service.cells.iterdir() if p.is_dir()}
    except OSError:
        return set()
