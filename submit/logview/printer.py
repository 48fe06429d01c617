"""How ``tilert-submit logs`` prints: ``name | `` prefixes, colours on a terminal, timestamps.

Like ``docker compose logs``: the prefix is padded to the longest name and coloured per source,
but only when stdout is a terminal, and never with ``--no-color`` or ``NO_COLOR`` set
(https://no-color.org), so a pipe or a file gets plain text. ``--timestamps`` puts the time each
line was received after the prefix (ISO 8601, UTC, milliseconds; ``-`` when it is not known).
Output is flushed after each batch of lines, so ``| grep`` sees them at once.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping
from typing import TextIO

from agent.job.logtail import LogLine
from agent.job.logtimes import format_time

# docker compose's palette: bright cyan, yellow, green, magenta, blue, then the plain ones.
COLOURS = ("96", "93", "92", "95", "94", "36", "33", "32", "35", "34")
_UNKNOWN_TIME = "-".ljust(len(format_time(0.0)))


def say(message: str) -> None:
    """A message for the user on stderr (stdout carries only log lines); never fails."""
    with contextlib.suppress(BrokenPipeError, ValueError):
        print(f"tilert-submit logs: {message}", file=sys.stderr, flush=True)


def wants_colour(out: TextIO, *, no_color: bool, env: Mapping[str, str]) -> bool:
    """Colour only on a terminal, unless ``--no-color`` or a non-empty ``NO_COLOR`` says no."""
    if no_color or env.get("NO_COLOR"):
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


class Printer:
    """Writes prefixed lines and flushes after each batch."""

    def __init__(
        self, out: TextIO, names: Iterable[str], *, colour: bool, timestamps: bool = False
    ) -> None:
        self.out = out
        self.order = list(names)
        self.width = max((len(n) for n in self.order), default=0)
        self.colour = colour
        self.timestamps = timestamps

    def prefix(self, name: str) -> str:
        """``name | `` padded to the longest name, coloured when colour is on."""
        if name not in self.order:
            self.order.append(name)
        text = f"{name:<{self.width}} |"
        if not self.colour:
            return text + " "
        code = COLOURS[self.order.index(name) % len(COLOURS)]
        return f"\033[{code}m{text}\033[0m "

    def emit(self, name: str, lines: Iterable[LogLine]) -> None:
        """Print ``lines`` of source ``name``."""
        prefix = self.prefix(name)
        if self.timestamps:
            text = "".join(f"{prefix}{_stamp(line.time)} {line.text}\n" for line in lines)
        else:
            text = "".join(f"{prefix}{line.text}\n" for line in lines)
        if text:
            self.out.write(text)
            self.out.flush()


def _stamp(t: float | None) -> str:
    return _UNKNOWN_TIME if t is None else format_time(t)
