"""Problems found in a recipe, a cluster file, a flag or a job directory: a key path + a fix.

Every check (YAML syntax, unknown keys, types, the load-time rules) produces ``Problem`` values so
that one run reports all of them together; ``InputError`` carries them to the CLI, which prints
``str(error)`` and exits 2. Never a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from agent.errors import BadInput

Severity = Literal["error", "warning"]


class Problem(msgspec.Struct, frozen=True):
    """One thing wrong (or doubtful) in the user's input, where it is, and how to fix it."""

    # Dotted key path as the user wrote it ("roles.decode.args.http-port", "frontend.args.vllm_url",
    # "--set roles.x=1"); "" for the whole file.
    path: str
    message: str
    # How to fix it, in one sentence.
    hint: str
    severity: Severity = "error"
    # 1-based line in the source file when known (None after --set, or for derived values).
    line: int | None = None


def printable(value: str) -> str:
    """``value`` with every unprintable character escaped (``\\n``, ``\\x00``, ``\\x1b``,
    ``\\u2028``).

    Messages are one line per problem, read in terminals and greppable logs: a newline, a NUL or an
    escape sequence taken from a user value (a name, a reason from a record) must not start a
    forged line, cut the message or drive the terminal.
    """
    if value.isprintable():
        return value
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value
    )


def error(path: str, message: str, hint: str, line: int | None = None) -> Problem:
    """An error-severity problem."""
    return Problem(path=path, message=message, hint=hint, severity="error", line=line)


def warning(path: str, message: str, hint: str, line: int | None = None) -> Problem:
    """A warning-severity problem (reported, exit status unchanged)."""
    return Problem(path=path, message=message, hint=hint, severity="warning", line=line)


def errors_of(problems: Sequence[Problem]) -> list[Problem]:
    """The error-severity problems, in order."""
    return [p for p in problems if p.severity == "error"]


def warnings_of(problems: Sequence[Problem]) -> list[Problem]:
    """The warning-severity problems, in order."""
    return [p for p in problems if p.severity == "warning"]


def _render_one(problem: Problem, source: str) -> str:
    # Paths and messages quote the user's keys and values: escaped here, once for every check, so
    # a newline or an escape sequence in a recipe cannot forge or hide a line of the report.
    where = printable(source)
    if problem.line is not None and source:
        where = f"{where}:{problem.line}"
    head = ": ".join(part for part in (where, printable(problem.path)) if part)
    message = printable(problem.message)
    text = f"{problem.severity}: {head}: {message}" if head else f"{problem.severity}: {message}"
    if problem.hint:
        text += f"\n    fix: {printable(problem.hint)}"
    return text


def render_problems(problems: Sequence[Problem], source: str) -> str:
    """One readable block: a count line, then errors, then warnings, each with its fix."""
    errs, warns = errors_of(problems), warnings_of(problems)
    counts = []
    if errs:
        counts.append(f"{len(errs)} error{'s' if len(errs) != 1 else ''}")
    if warns:
        counts.append(f"{len(warns)} warning{'s' if len(warns) != 1 else ''}")
    title = f"{printable(source) or 'input'}: {', '.join(counts) or 'no problems'}"
    return "\n".join([title, *(_render_one(p, source) for p in [*errs, *warns])])


class InputError(BadInput):
    """Bad user input (recipe, cluster file, flags, job directory): every problem, via ``str()``."""

    def __init__(self, problems: Sequence[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(render_problems(self.problems, source))

    def __str__(self) -> str:
        return render_problems(self.problems, self.source)
