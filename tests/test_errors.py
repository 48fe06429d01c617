"""The error tree of agent/errors.py is the code's: every error class is drawn where it descends.

The drawing in the module docstring is what a newcomer reads; this test reads it, imports each
class from the module it names and checks its branch, and scans the code for an error class the
drawing leaves out.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from agent import errors

ROOT = Path(__file__).resolve().parent.parent
# "│   ├── InputError            agent.problems: ..." -> depth (in columns), class, module.
_LINE = re.compile(r"^(?P<indent>[│ ]*)[├└]── (?P<name>\w+)\s+(?P<module>(?:agent|submit)[\w.]*):")
_BRANCH = re.compile(r"^(?P<indent>[│ ]*)[├└]── (?P<name>\w+)\s")


def drawn() -> dict[str, tuple[str, str]]:
    """Each drawn class -> (its module, the branch it hangs from)."""
    found: dict[str, tuple[str, str]] = {}
    branch = "TilertError"
    for line in (errors.__doc__ or "").splitlines():
        text = line.strip("\n")[4:]  # the drawing is indented by four spaces
        leaf = _LINE.match(text)
        if leaf is None:
            top = _BRANCH.match(text)
            if top is not None and not top["indent"]:
                branch = top["name"]
            continue
        parent = branch if leaf["indent"] else "TilertError"
        found[leaf["name"]] = (leaf["module"], parent)
    return found


def test_the_drawing_names_both_branches_and_every_class() -> None:
    tree = drawn()
    assert {"InputError", "JobFailed", "BackendError", "HTTPError"} <= set(tree)
    assert len(tree) >= 21


@pytest.mark.parametrize(("name", "where"), sorted(drawn().items()))
def test_each_drawn_class_lives_and_descends_where_drawn(name: str, where: tuple[str, str]) -> None:
    module, parent = where
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, getattr(errors, parent)), f"{module}.{name} is not a {parent}"
    expected = errors.EXIT_BAD_INPUT if parent == "BadInput" else errors.EXIT_RUNTIME
    assert cls.exit_code == expected


def _error_classes() -> set[str]:
    """Every public class of agent/ and submit/ whose base is an exception class by name."""
    found = set()
    for package in ("agent", "submit"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                    continue
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                ours = bases & {"BadInput", "TilertError"}
                if ours or any(b.endswith(("Error", "Exception", "Failure")) for b in bases):
                    found.add(node.name)
    return found - {"TilertError", "BadInput", "RuntimeFailure"}


def test_no_error_class_is_left_out_of_the_tree() -> None:
    missing = _error_classes() - set(drawn())
    assert not missing, f"draw these in agent/errors.py and give them a branch: {sorted(missing)}"
