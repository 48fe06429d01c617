"""The code's size read from the code: no function over 80 lines, no module over 600, no class
with more than 20 methods.

The house rule (docs/ARCHITECTURE.md, "Short functions, short modules"), beside ruff's C901: a
long function is split along its seams, a long module along its concepts, a class that does too
much into the objects it is made of. Every Python file of ``agent/``, ``submit/`` and ``tests/``
counts, tests included; a function's length runs from its ``def`` (decorators excluded) to its
last line, nested functions inside it included; a class's methods are the functions defined
directly in its body (properties and static methods included, nested functions not).

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
MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 20

# "path" for a module, "path::Qualified.name" for a function -> why it is over, for now.
EXEMPT: dict[str, str] = {
    "agent/recipe/loader.py": "the recipe's load path (611 lines); to split along its stages "
    "(read, resolve, check) once the CLI's import-time work in agent/recipe/ has landed",
    "agent/recipe/schema1.py": "the v1 schema's translation (609 lines); to split by section, "
    "with the loader",
    "agent/recipe/typedyaml.py": "the typed YAML reader and its shape checker (628 lines); to "
    "split the ShapeChecker out, with the loader",
    "tests/test_e2e_observability.py": "one local job shared by its tests (a module fixture: a "
    "split would start a second job); to split by what it observes (metrics, logs, stop)",
}
# "path::Class" -> why it has more methods than MAX_CLASS_METHODS, for now. Never Head,
# EngineSupervisor or NodeAgent: the classes the job's growth used to land in.
EXEMPT_CLASSES: dict[str, str] = {
    "tests/infra/slurm.py::LocalSlurm": "a local Slurm's configuration, daemons and job queries: "
    "to split the queries out",
}


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


@functools.cache
def _classes() -> dict[str, int]:
    """The method count of every class (``path::Qualified.Name``, nested classes too)."""
    counts: dict[str, int] = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                counts[f"{rel}::{name}"] = sum(
                    isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef) for c in child.body
                )
                visit(child, rel, name + ".")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, rel, prefix + child.name + ".")
            else:
                visit(child, rel, prefix)

    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=rel), rel, "")
    return counts


def _big_classes(counts: dict[str, int]) -> dict[str, int]:
    return {key: n for key, n in counts.items() if n > MAX_CLASS_METHODS}


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


def test_no_class_with_too_many_methods() -> None:
    big = _big_classes(_classes())
    for key, why in EXEMPT_CLASSES.items():
        if key in big:
            print(f"exempt for now: {key} ({big[key]} methods): {why}")
    over = {key: n for key, n in big.items() if key not in EXEMPT_CLASSES}
    listing = "\n".join(f"  {key}: {n} methods" for key, n in sorted(over.items()))
    assert not over, (
        f"over {MAX_CLASS_METHODS} methods a class; split each into the objects it is made of "
        f"(as agent.head.poolkeeper, agent.head.proof and agent.node.handover were):\n{listing}"
    )


def test_every_class_exemption_is_still_needed() -> None:
    counts = _classes()
    big = _big_classes(counts)
    stale = {key: counts.get(key) for key in EXEMPT_CLASSES if key not in big}
    assert not stale, f"no longer over the limit (or gone): remove from EXEMPT_CLASSES: {stale}"


def test_the_central_classes_are_never_exempt() -> None:
    central = {
        "agent/head/head.py::Head",
        "agent/node/supervisor.py::EngineSupervisor",
        "agent/nodeagent.py::NodeAgent",
    }
    assert central <= set(_classes()), "a central class moved: follow it here"
    assert not central & set(EXEMPT_CLASSES)


def test_the_scan_sees_what_it_must() -> None:
    # A check that cannot fail is no check: the scan must find nested and class functions.
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n")
    assert [name for name, _ in _functions(tree)] == ["A.f", "A.f.g"]
    assert "agent/http/endpoint.py::build_app" in _sizes()
    assert _offenders({"m.py": 601, "m.py::f": 81, "n.py": 600, "n.py::g": 80}) == {
        "m.py": 601,
        "m.py::f": 81,
    }
    assert _classes()["agent/node/supervisor.py::Stats"] == 0
    assert _big_classes({"a.py::A": 21, "b.py::B": 20}) == {"a.py::A": 21}
