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
LAYERS: dict[str, int] = {
    "agent.facts": 0,
    "agent.problems": 0,
    "agent.errors": 0,
    "agent.job": 1,
    "agent.recipe": 2,
    "agent.launch": 2,
    "agent.node": 3,
    "agent.benchmark": 3,  # the benchmark client's runner: the head's, and tilert-submit bench's
    "agent.http": 4,
    "agent.head": 5,
    "agent.nodeagent": 6,
    "agent.convertjob": 6,  # the agent of a `tilert-submit convert` job, beside the node agent
    "agent.main": 7,
    "agent": 0,  # the package's own __init__ (version only)
    "submit": 8,
}
# Who may not import whom, beyond the layer order.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "submit": ("agent.head", "agent.http", "agent.nodeagent", "agent.main"),
    "agent.standins": (
        "agent.job",
        "agent.recipe",
        "agent.launch",
        "agent.node",
        "agent.head",
        "agent.nodeagent",
        "agent.main",
        "submit",
    ),
    "agent": ("submit",),
}


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


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best]


GRAPH = {
    name: sorted(set(_imports(name, path, set(_modules())))) for name, path in _modules().items()
}


def test_the_graph_covers_every_layer() -> None:
    prefixes = {_layer(m)[0] for m in GRAPH}
    assert {"agent.job", "agent.recipe", "agent.launch", "agent.node", "agent.http"} <= prefixes
    assert {"agent.head", "agent.nodeagent", "submit"} <= prefixes


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in GRAPH[module]:
            # A package's __init__ re-exporting its own modules is not a cycle between concepts.
            if module.startswith(target + ".") or target.startswith(module + "."):
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif state.get(target) is None:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_respect_the_layers(module: str) -> None:
    _, level = _layer(module)
    wrong = []
    for target in GRAPH[module]:
        prefix, target_level = _layer(target)
        if module.startswith("agent.standins") or prefix == "agent":
            continue
        if target_level > level:
            wrong.append(f"{target} (layer {target_level} > {level})")
    for scope, banned in FORBIDDEN.items():
        if module == scope or module.startswith(scope + "."):
            wrong += [t for t in GRAPH[module] for b in banned if t == b or t.startswith(b + ".")]
    assert not wrong, f"{module} imports above its layer: {', '.join(wrong)}"
