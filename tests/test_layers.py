"""The import graph read from the code: no cycle, and each layer imports only the layers below it.

docs/ARCHITECTURE.md draws the layers; this test keeps the drawing true. Imports inside functions
and under ``TYPE_CHECKING`` count too: a layer that needs a name from above has the wrong shape.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "submit")

# Layer of each package prefix (longest prefix wins); a module may import its own layer or lower.
# Every package has an entry, the stand-ins included: no module is exempt from the checks below.
LAYERS: dict[str, int] = {
    "agent.facts": 0,
    "agent.problems": 0,
    "agent.web": 1,  # the ASGI toolkit: the agent's endpoint and the stand-ins serve HTTP with it
    "agent.errors": 0,
    "agent.job": 1,
    "agent.standins": 2,  # separate programs (the engines' stand-ins): facts and the toolkit only
    "agent.recipe": 2,
    "agent.launch": 2,
    "agent.front": 2,  # the front door: the toolkit and the job's formats only (the head runs it)
    "agent.node": 3,
    "agent.benchmark": 3,  # the benchmark client's runner: the head's, and tilert-submit bench's
    "agent.http": 4,
    "agent.service": 4,  # the service front and its cells (tilert-submit serve runs it)
    "agent.head": 5,
    "agent.nodeagent": 6,
    "agent.convertjob": 6,  # the agent of a `tilert-submit convert` job, beside the node agent
    "agent.main": 7,
    "agent": 0,  # the package's own __init__ (version only)
    "submit": 8,
}
# Who may not import whom, beyond the layer order (packages that share a layer stay apart).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "submit": ("agent.head", "agent.http", "agent.nodeagent", "agent.convertjob", "agent.main"),
    "agent.web": ("agent.job",),
    "agent.job": ("agent.web",),
    "agent.recipe": ("agent.launch", "agent.standins"),
    "agent.launch": ("agent.recipe", "agent.standins"),
    "agent.front": ("agent.recipe", "agent.launch", "agent.standins"),
    "agent.service": ("agent.http", "agent.launch", "agent.standins", "agent.benchmark"),
    "agent.standins": ("agent.job", "agent.recipe", "agent.launch", "agent.problems"),
    "agent": ("submit",),
}
# Programs of their own, started by module name (agent.launch.commands.STANDIN_MODULES): nothing
# outside them imports them.
PROGRAMS = ("agent.standins",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module of ours that ``name`` imports (``from a import b`` counts as ``a.b`` if it is
    one)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                yield target


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best]


GRAPH = {
    name: sorted(set(_imports(name, path, set(_modules())))) for name, path in _modules().items()
}


# The package graph: each layer-table package -> the other packages its modules import.
PACKAGE_GRAPH = {
    package: sorted(
        {_layer(t)[0] for m in GRAPH if _layer(m)[0] == package for t in GRAPH[m]} - {package}
    )
    for package in sorted(LAYERS)
}


def test_the_graph_covers_every_layer() -> None:
    prefixes = {_layer(m)[0] for m in GRAPH}
    # Every entry of the table names modules that exist, and every module falls under an entry.
    assert prefixes == set(LAYERS)
    assert all(module in GRAPH for module in LAYERS)


def test_no_package_cycle() -> None:
    """No cycle between packages (``pytest -s`` shows the graph checked)."""
    print("\npackage graph (layer: package -> what it imports):")
    for package, targets in sorted(PACKAGE_GRAPH.items(), key=lambda kv: (LAYERS[kv[0]], kv[0])):
        print(f"  {LAYERS[package]}: {package} -> {', '.join(targets) or '(nothing of ours)'}")
    cycles = _cycles({p: t for p, t in PACKAGE_GRAPH.items()})
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


def _cycles(graph: dict[str, list[str]]) -> list[str]:
    """Every cycle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in graph[node]:
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif state.get(target) is None:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle() -> None:
    # A package's __init__ re-exporting its own modules is not a cycle between concepts.
    graph = {
        module: [t for t in targets if not _within(module, t) and not _within(t, module)]
        for module, targets in GRAPH.items()
    }
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_respect_the_layers(module: str) -> None:
    _, level = _layer(module)
    wrong = []
    for target in GRAPH[module]:
        prefix, target_level = _layer(target)
        if prefix == "agent":  # the version, importable by all
            continue
        if target_level > level:
            wrong.append(f"{target} (layer {target_level} > {level})")
    for scope, banned in FORBIDDEN.items():
        if _within(module, scope):
            wrong += [t for t in GRAPH[module] for b in banned if _within(t, b)]
    for program in PROGRAMS:
        if not _within(module, program):
            wrong += [t for t in GRAPH[module] if _within(t, program)]
    assert not wrong, f"{module} imports above its layer: {', '.join(wrong)}"


def test_the_cycle_finder_finds_cycles() -> None:
    """The walk behind both cycle tests reports a cycle it is shown (so a pass means something)."""
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a -> b -> c -> a"]
    assert _cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []
