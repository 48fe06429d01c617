"""Where ``-o FILE`` writes (``migrate``, ``init``): standard output for ``-``, else a regular file,
created, or replaced with ``--force``, atomically.

The target is judged with ``lstat``, never through a symbolic link: a link is refused (one
planted where a user writes would redirect the write), and so is anything that is not a regular
file (a FIFO would block the write or feed a reader, a device would receive it, a folder cannot
be replaced). An existing regular file is replaced only with ``--force``. The write is
``write_atomic``'s (a temp file renamed over the name; a rename never follows a link either).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from agent.job.atomicfile import write_atomic

STDOUT = "-"

_KINDS = (
    (stat.S_ISLNK, "a symbolic link (never followed)"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def output_problem(output: str, *, force: bool) -> str | None:
    """Why ``-o output`` cannot be written (naming the flag and the fix), or None when it can."""
    if output == STDOUT:
        return None
    path = Path(output)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        folder = path.absolute().parent
        if folder.is_dir():
            return None
        return f"-o {output}: the folder {folder} does not exist; create it, or pass another FILE"
    except OSError as exc:
        return f"-o {output}: {exc.strerror or exc}; pass another FILE"
    if not stat.S_ISREG(st.st_mode):
        return (
            f"-o {output}: exists and is {_kind(st.st_mode)}, not a regular file; pass another "
            f"FILE, or -o {STDOUT} for standard output"
        )
    if not force:
        return f"-o {output}: exists; pass --force to replace it, or another FILE"
    return None


def write_output(output: str, text: str) -> Path | None:
    """``text`` to standard output (``-``) or atomically into the file (0644); the file, if any.

    Call ``output_problem`` first; OSError when the write fails."""
    if output == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return None
    path = Path(output)
    write_atomic(path, text.encode(), mode=0o644)
    return path
