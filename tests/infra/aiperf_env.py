"""A venv with NVIDIA's AIPerf (PyPI ``aiperf``), the benchmark client the benchmark tests run.

AIPerf is heavy (pandas, plotly, transformers, kaleido...: about 1.2 GB and 3.5 minutes the first
time), so it lives in a venv of its own under ``.cache/`` next to the router venv, built once and
reused; the project's own install stays light. AIPerf 0.13 needs Python 3.11 to 3.13: the venv is
made from the interpreter that runs this module when it fits (the project's venv is 3.11), else
from python3.12.

    python -m tests.infra.aiperf_env DEST     # builds DEST if needed, prints its aiperf
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.infra import venvs
from tests.infra.venvs import find_python

AIPERF = "aiperf==0.13.0"
MARKER = ".tilert-aiperf-venv"
MARKER_TEXT = f"{AIPERF}\n"


def _aiperf(dest: Path) -> Path:
    return dest / "bin" / "aiperf"


def _is_ready(dest: Path) -> bool:
    marker = dest / MARKER
    return _aiperf(dest).exists() and marker.exists() and marker.read_text() == MARKER_TEXT


def _base_python() -> Path | None:
    """An interpreter AIPerf accepts (3.11 to 3.13): this one's base, else python3.12."""
    if (3, 11) <= sys.version_info[:2] <= (3, 13):
        base = getattr(sys, "_base_executable", None) or sys.executable
        return Path(base)
    return find_python("3.12")


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


def ensure_aiperf_venv(dest: Path) -> Path:
    """The ``aiperf`` executable of a venv at ``dest``; builds it (~3.5 min, 1.2 GB) if missing."""
    dest = dest.absolute()
    if _is_ready(dest):
        return _aiperf(dest)
    python = _base_python()
    if python is None:
        raise RuntimeError(
            "AIPerf needs Python 3.11 to 3.13 and none was found; install one, or set "
            "TILERT_AIPERF to an aiperf executable"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
        if _is_ready(dest):
            return _aiperf(dest)
        if dest.exists():
            shutil.rmtree(dest)  # a half-built venv from an interrupted run
        _run([str(python), "-m", "venv", str(dest)])
        pip = [str(dest / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        _run([*pip, "--disable-pip-version-check", AIPERF])
        _run([str(_aiperf(dest)), "--version"])
        (dest / MARKER).write_text(MARKER_TEXT)
    return _aiperf(dest)


def aiperf_executable(default_dest: Path) -> Path:
    """TILERT_AIPERF when set, else the venv at ``default_dest`` (built if needed)."""
    override = os.environ.get("TILERT_AIPERF", "").strip()
    return Path(override) if override else ensure_aiperf_venv(default_dest)


def main(argv: list[str]) -> int:
    """CLI: build the venv at DEST and print its aiperf."""
    return venvs.main("tests.infra.aiperf_env", ensure_aiperf_venv, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
