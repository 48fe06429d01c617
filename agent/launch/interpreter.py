"""Which Python runs an engine's program, found the way the engine's own exec would find it.

The preflight must check the interpreter that will run the engine, with the engine's PATH: the
``vllm`` on the engine's PATH (a venv's console script) is not the agent's, and a recipe's
``python`` is whatever the engine's PATH names. A program is resolved on the engine's PATH; a
Python interpreter is itself, a console script names its interpreter on its ``#!`` line. A site's
own launcher (a shell script) names no interpreter: then only the program itself can be checked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHEBANG_LIMIT = 512


def resolve(program: str, path: str | None) -> str | None:
    """``program`` as the engine's exec finds it on ``path`` (its PATH), or None."""
    return shutil.which(program, path=path if path is not None else os.defpath)


def is_python(program: str) -> bool:
    """Whether ``program`` names a Python interpreter (``python``, ``python3.11``, a path to
    one)."""
    name = Path(program).name
    return name == "python" or (name.startswith("python") and name[6:].replace(".", "").isdigit())


def shebang_python(script: str, path: str | None) -> str | None:
    """The Python interpreter a script's ``#!`` line names (``/usr/bin/env python3`` too), or
    None."""
    try:
        with open(script, "rb") as f:
            first = f.read(SHEBANG_LIMIT).split(b"\n", 1)[0]
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words:
        return None
    if Path(words[0]).name == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
        if not words or not is_python(words[0]):
            return None
        return resolve(words[0], path)
    return words[0] if is_python(words[0]) else None


def python_of(program: str, path: str | None) -> str | None:
    """The interpreter that runs ``program`` on ``path``: itself or its ``#!``; None if unknown."""
    if is_python(program):
        return program
    found = resolve(program, path)
    return shebang_python(found, path) if found else None
