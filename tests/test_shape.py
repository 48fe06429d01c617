"""The code's size read from the code: no function over 80 lines, no module over 650.

The house rule (docs/ARCHITECTURE.md, "Short functions, short modules"), beside ruff's C901: a
long function is split along its seams, a long module along its concepts. Every Python file of
``agent/``, ``submit/`` and ``tests/`` counts, tests included; a function's length runs from its
``def`` (decorators excluded) to its last line, nested functions inside it included.

``EXEMPT`` names, with the reason, what may exceed for now; nothing else is skipped, and an
exemption that is no longer needed fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("agent", "submit", "tests")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 650

# "path" for a module, "path::Qualified.name" for a function -> why it is over, for now.
EXEMPT: dict[str, str] = {}


def _files() -> list[Path]:
    return sorted(path for tree in TREES for path in (ROOT / tree).rglob("*.py"))


def _functions(
    node: ast.AST, prefix: str = ""
) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` with its qualified name (``Class.method``, ``f.inner``)."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + child.name
            found.append((name, child))
            found += _functions(child, name + ".")
        elif isinstance(child, ast.ClassDef):
            found += _functions(child, prefix + child.name + ".")
        else:
            found += _functions(child, prefix)
    return found


@functools.cache
def _sizes() -> dict[str, int]:
    """Lines of every module (``path``) and every function (``path::name``)."""
    sizes: dict[str, int] = {}
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        sizes[rel] = len(text.splitlines())
        for name, func in _functions(ast.parse(text, filename=rel)):
            end = func.end_lineno if func.end_lineno is not None else func.lineno
            sizes[f"{rel}::{name}"] = end - func.lineno + 1
    return sizes


def _offenders(sizes: dict[str, int]) -> dict[str, int]:
    return {
        key: size
        for key, size in sizes.items()
        if size > (MAX_FUNCTION_LINES if "::" in key else MAX_MODULE_LINES)
    }


def test_no_long_function_and_no_long_module() -> None:
    offenders = _offenders(_sizes())
    for key, why in EXEMPT.items():
        if key in offenders:
            print(f"exempt for now: {key} ({offenders[key]} lines): {why}")
    over = {key: size for key, size in offenders.items() if key not in EXEMPT}
    listing = "\n".join(f"  {key}: {size} lines" for key, size in sorted(over.items()))
    assert not over, (
        f"over {MAX_FUNCTION_LINES} lines (a function) or {MAX_MODULE_LINES} (a module); split "
        f"them along their seams:\n{listing}"
    )


def test_every_exemption_is_still_needed() -> None:
    sizes = _sizes()
    offenders = _offenders(sizes)
    stale = {key: sizes.get(key) for key in EXEMPT if key not in offenders}
    assert not stale, f"no longer over the limit (or gone): remove from EXEMPT: {stale}"


def test_the_scan_sees_what_it_must() -> None:
    # A check that cannot fail is no check: the scan must find nested and class functions.
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n")
    assert [name for name, _ in _functions(tree)] == ["A.f", "A.f.g"]
    assert "agent/http/endpoint.py::build_app" in _sizes()
    assert _offenders({"m.py": 651, "m.py::f": 81, "n.py": 650, "n.py::g": 80}) == {
        "m.py": 651,
        "m.py::f": 81,
    }
