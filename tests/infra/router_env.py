"""A Python 3.12 venv in which the REAL TileRT router (tilert 0.1.6.post3) runs on a CPU machine.

The wheel is cp312-only and does not declare its dependencies, and ``tilert/__init__.py`` imports
torch only to check ``torch.ops``. So: a venv from python3.12, ``pip install --no-deps`` the wheel,
then the router's real dependencies, and a ``sitecustomize.py`` that registers a placeholder
``torch`` module when no torch is importable. The unchanged production command
``python -m tilert.pd_vllm.pd_router ...`` then starts with the venv's python.

    python -m tests.infra.router_env DEST     # builds DEST if needed, prints its python
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.infra import venvs
from tests.infra.venvs import find_python, venv_python

TILERT = "tilert==0.1.6.post3"
ROUTER_DEPS = ("fastapi", "uvicorn", "requests", "httpx", "transformers", "tokenizers", "jinja2")
MARKER = ".tilert-router-venv"
MARKER_TEXT = f"{TILERT} {' '.join(ROUTER_DEPS)} sitecustomize-v1\n"

SITECUSTOMIZE = '''\
"""Placeholder torch for the TileRT router on a CPU-only machine (tests/infra/router_env.py).

tilert/__init__.py imports torch only to check torch.ops; the router itself never uses it.
__version__ "0.0.0+stub" makes transformers treat torch as absent.
"""
import importlib.machinery
import importlib.util
import sys
import types

if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
    torch = types.ModuleType("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    torch.__version__ = "0.0.0+stub"
    torch.ops = types.SimpleNamespace()
    torch.version = types.SimpleNamespace(cuda=None, hip=None)
    sys.modules["torch"] = torch
'''


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def write_sitecustomize(python: Path) -> Path:
    """Install the torch placeholder into the site-packages of ``python``'s venv."""
    target = _site_packages(python) / "sitecustomize.py"
    if not target.exists() or target.read_text() != SITECUSTOMIZE:
        target.write_text(SITECUSTOMIZE)
    return target


def _is_ready(dest: Path) -> bool:
    marker = dest / MARKER
    return venv_python(dest).exists() and marker.exists() and marker.read_text() == MARKER_TEXT


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


def ensure_router_venv(dest: Path) -> Path:
    """The python of a venv at ``dest`` that runs TileRT's router; builds it (~40 s) if missing."""
    dest = dest.absolute()
    if _is_ready(dest):
        return venv_python(dest)
    python312 = find_python("3.12")
    if python312 is None:
        raise RuntimeError(
            "the real TileRT router needs Python 3.12 (tilert 0.1.6 ships cp312 wheels only) and "
            "none was found: looked for python3.12 on PATH, ~/.pyenv/versions/3.12*/bin, "
            "/usr/bin/python3.12 and /usr/local/bin/python3.12. Install one (e.g. `pyenv install "
            "3.12`) or set TILERT_ROUTER_PYTHON to a python that imports tilert.pd_vllm.pd_router."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
        if _is_ready(dest):
            return venv_python(dest)
        if dest.exists():
            shutil.rmtree(dest)  # a half-built venv from an interrupted run
        _run([str(python312), "-m", "venv", str(dest)])
        python = venv_python(dest)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", TILERT])
        _run([*pip, *ROUTER_DEPS])
        write_sitecustomize(python)
        _run([str(python), "-c", "import tilert.pd_vllm.pd_router"])
        (dest / MARKER).write_text(MARKER_TEXT)
    return python


def router_python(default_dest: Path) -> Path:
    """TILERT_ROUTER_PYTHON when set, else the venv at ``default_dest`` (built if needed)."""
    override = os.environ.get("TILERT_ROUTER_PYTHON", "").strip()
    return Path(override) if override else ensure_router_venv(default_dest)


def main(argv: list[str]) -> int:
    """CLI: build the venv at DEST and print its python."""
    return venvs.main("tests.infra.router_env", ensure_router_venv, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
