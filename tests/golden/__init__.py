"""Golden snapshots: ``UPDATE_GOLDEN=1 pytest ...`` rewrites them (review the diff, then commit)."""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).parent
REPO = GOLDEN_DIR.parent.parent
RECIPES = REPO / "recipes"


def match(name: str, text: str) -> None:
    """Assert ``text`` equals the snapshot ``tests/golden/<name>`` (or rewrite it on request)."""
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"no snapshot {path}: run with UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    assert text == expected, f"{name} changed; if intended, rerun with UPDATE_GOLDEN=1"
