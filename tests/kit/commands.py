"""The project's commands as tests run them: ``tilert-submit`` and ``tilert-agent``.

Both run as ``python -m`` from this checkout with this interpreter, the way ``tilert-submit
--local`` starts its agents, so a test exercises the code next to it whatever is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_RECIPE = REPO / "recipes" / "local-demo.yaml"
SUBMIT = [sys.executable, "-m", "submit.cli"]
AGENT = [sys.executable, "-m", "agent.main"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without inherited TILERT_* switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def submit_cmd(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``tilert-submit ARGS`` to its end (a dry run, status, stop, logs, a Slurm submission)."""
    return subprocess.run(
        [*SUBMIT, *args],
        cwd=REPO,
        env=dict(env or os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
