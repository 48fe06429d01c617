"""What the cached test venvs (router, vLLM, AIPerf) share: finding an interpreter, their CLI.

Each ``tests/infra/*_env.py`` builds one venv under ``.cache/`` and is run by tests/run.sh as
``python -m tests.infra.<name>_env DEST``, printing the path a test needs.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def find_python(version: str) -> Path | None:
    """A Python ``version`` (``"3.12"``) on PATH, under pyenv, or in /usr(/local)/bin."""
    name = f"python{version}"
    candidates: list[str] = []
    on_path = shutil.which(name)
    if on_path:
        candidates.append(on_path)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(
        glob.glob(str(pyenv_root / "versions" / f"{version}*" / "bin" / name)), reverse=True
    )
    candidates += [f"/usr/bin/{name}", f"/usr/local/bin/{name}"]
    for candidate in candidates:
        path = Path(candidate)
        if path.is_file() and os.access(path, os.X_OK) and _is_version(path, version):
            return path
    return None


def _is_version(path: Path, version: str) -> bool:
    # A pyenv shim on PATH exists even when no such version is installed behind it.
    wanted = tuple(int(part) for part in version.split("."))
    try:
        out = subprocess.run(
            [str(path), "-c", f"import sys; print(sys.version_info[:2] == {wanted!r})"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "True"


def venv_python(dest: Path) -> Path:
    """The interpreter of the venv at ``dest``."""
    return dest / "bin" / "python"


def main(module: str, ensure: Callable[[Path], Path], argv: list[str]) -> int:
    """``python -m MODULE DEST``: build (or reuse) the venv at DEST, print what ``ensure`` gives."""
    if len(argv) != 1:
        print(f"usage: python -m {module} DEST", file=sys.stderr)
        return 2
    try:
        print(ensure(Path(argv[0])))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
