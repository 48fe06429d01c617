"""The map is true: every module the docs and docstrings name exists, and every "May import" line
agrees with the layer table of tests/test_layers.py and with the imports read from the code.

What counts as a reference:

- a path ``agent/<package>/<module>.py``, ``submit/...``, ``tests/...`` (a folder, a file or a
  glob) anywhere in ``docs/*.md`` and ``README.md``, or in a docstring or comment of ``agent/``,
  ``submit/``, ``tests/``;
- a dotted name ``agent.<package>.<module>`` or ``agent.<package>.<module>.<Name>`` in the same
  places: its longest prefix that is a module must exist, and the next part, if any, must be
  defined or imported at that module's top level. Names that are not modules by construction are
  skipped: the recipe's ``agent:`` keys (``agent.probe.interval_s``, read from the recipe model)
  and file names (``agent.log``);
- the tree of ``docs/ARCHITECTURE.md`` ("The packages"), read by its indentation;
- a package docstring's bullet ``- ``name``: ...``, a module of that package.

A "May import" paragraph of a package docstring lists what the package may import; names after
"never" or "nothing" are what it must not import, and "Imported by ``x`` only" names its only
importers. Each failure names the file and line of the stale reference.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import msgspec

from agent.recipe.model import AgentSection
from tests.test_layers import FORBIDDEN, GRAPH, LAYERS

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("agent", "submit", "tests")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_PATH = re.compile(r"(?<![\w/.~$-])((?:agent|submit|tests)/[\w*/.-]*[\w*/])")
_DOTTED = re.compile(r"(?<![\w/.~$:-])((?:agent|submit|tests)(?:\.\w+)+)")
# A dotted word that names a file, not a module: agent.log, agent.md, agent.env.example.
_FILE_SUFFIXES = {"md", "log", "json", "yaml", "yml", "example", "txt", "sh", "py", "toml", "out"}
# The recipe's `agent:` section: agent.probe.interval_s is a key, not a module.
_RECIPE_AGENT_KEYS = {field.encode_name for field in msgspec.structs.fields(AgentSection)}


@dataclass(frozen=True)
class Text:
    """A piece of prose to read: its file, its first line's number, the text."""

    path: Path
    line: int
    text: str

    def lines(self) -> Iterator[tuple[int, str]]:
        """Each line with its number in the file."""
        for offset, line in enumerate(self.text.splitlines()):
            yield self.line + offset, line


def _python_files() -> list[Path]:
    return sorted(p for top in TOPS for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


def _docstrings(path: Path, tree: ast.Module) -> Iterator[Text]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                value = body[0].value.value
                if isinstance(value, str):
                    yield Text(path, body[0].lineno, value)


def _comments(path: Path, source: str) -> Iterator[Text]:
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield Text(path, token.start[0], token.string)


@cache
def _texts() -> tuple[Text, ...]:
    """Every piece of prose that may name a module: the docs, and docstrings and comments."""
    found = [Text(path, 1, path.read_text()) for path in DOCS]
    for path in _python_files():
        source = path.read_text()
        found += _docstrings(path, ast.parse(source, str(path)))
        found += _comments(path, source)
    return tuple(found)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# ---- modules and the names they define -----------------------------------------------------


def _module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` (a package's __init__.py, or a plain folder), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.is_dir():
        return base
    return None


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level (a plain folder: its entries)."""
    if path.is_dir():
        return frozenset(p.stem for p in path.iterdir())
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.iterdir() if p.suffix == ".py" or p.is_dir()}
    return frozenset(names)


def resolve(dotted: str) -> tuple[str, str | None] | None:
    """``(module, attribute)`` for a dotted name that exists, else None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        path = _module_file(module)
        if path is None:
            continue
        if cut == len(parts):
            return module, None
        if parts[cut] in _top_level_names(path):
            return module, parts[cut]
        return None
    return None


def _skipped(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] in _FILE_SUFFIXES:
        return True
    return parts[0] == "agent" and parts[1] in _RECIPE_AGENT_KEYS


def _path_exists(reference: str) -> bool:
    if "*" in reference:
        return any(ROOT.glob(reference.rstrip("/")))
    return (ROOT / reference).exists()


def stale_references(texts: tuple[Text, ...]) -> list[str]:
    """Every path or dotted name in ``texts`` that names nothing, with its file and line."""
    stale = []
    for text in texts:
        for number, line in text.lines():
            for match in _PATH.finditer(line):
                if not _path_exists(match.group(1)):
                    stale.append(f"{_where(text.path, number)}: {match.group(1)} does not exist")
            for match in _DOTTED.finditer(line):
                dotted = match.group(1)
                if not _skipped(dotted) and resolve(dotted) is None:
                    stale.append(f"{_where(text.path, number)}: {dotted} does not exist")
    return stale


# ---- docs/ARCHITECTURE.md's tree -----------------------------------------------------------

_TREE_ENTRY = re.compile(r"^( *)([\w.-]+/|[\w.-]+\.py)(?=\s|$)")


def architecture_tree() -> Iterator[tuple[int, str]]:
    """``(line, path)`` of every folder and module the tree of "The packages" draws."""
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    start = lines.index("## The packages")
    fence = [i for i, line in enumerate(lines) if i > start and line.startswith("```")][:2]
    stack: list[tuple[int, str]] = []  # (indent, folder)
    for number in range(fence[0] + 1, fence[1]):
        match = _TREE_ENTRY.match(lines[number])
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(folder for _, folder in stack) + name
        yield number + 1, path
        if name.endswith("/"):
            stack.append((indent, name))


def stale_tree_entries() -> list[str]:
    """The tree's entries that are not in the repository."""
    doc = ROOT / "docs" / "ARCHITECTURE.md"
    return [
        f"{_where(doc, line)}: {path} (the tree of 'The packages') does not exist"
        for line, path in architecture_tree()
        if not (ROOT / path).exists()
    ]


def unmapped_modules() -> list[str]:
    """Modules of agent/ and submit/ that neither the tree nor their package's docstring names."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    drawn = {path for _, path in architecture_tree()}
    missing = []
    for path in sorted(p for top in ("agent", "submit") for p in (ROOT / top).rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        relative = str(path.relative_to(ROOT))
        init = path.parent / "__init__.py"
        package_doc = _package_docstring(init) if init.is_file() else None
        named = package_doc is not None and f"``{path.stem}``" in package_doc.text
        in_doc = re.search(rf"(?<![\w.]){re.escape(path.name)}", doc) is not None
        if relative not in drawn and not in_doc and not named:
            missing.append(f"{relative} is on no map (docs/ARCHITECTURE.md, its package docstring)")
    return missing


# ---- package docstrings: bullets and "May import" ------------------------------------------

_BULLET = re.compile(r"^- ``(\w+)``")
_QUOTED = re.compile(r"``([\w.]+)``")


def _packages() -> dict[str, Path]:
    """Every package of agent/ and submit/ by dotted name, with its __init__.py."""
    return {
        ".".join(p.parent.relative_to(ROOT).parts): p
        for top in ("agent", "submit")
        for p in sorted((ROOT / top).rglob("__init__.py"))
    }


def _package_docstring(init: Path) -> Text | None:
    tree = ast.parse(init.read_text())
    return next((t for t in _docstrings(init, tree) if t.line <= (tree.body[0].lineno)), None)


def stale_bullets() -> list[str]:
    """A package docstring's ``- ``name``:`` bullets that name no module of the package."""
    stale = []
    for package, init in [*_packages().items(), ("tests.kit", ROOT / "tests/kit/__init__.py")]:
        doc = _package_docstring(init)
        for number, line in doc.lines() if doc else ():
            match = _BULLET.match(line)
            if match and _module_file(f"{package}.{match.group(1)}") is None:
                stale.append(f"{_where(init, number)}: {package}.{match.group(1)} does not exist")
    return stale


@dataclass(frozen=True)
class ImportRule:
    """A package's "May import" paragraph, read: what it allows, forbids, and who imports it."""

    package: str
    where: str
    allowed: tuple[str, ...]  # modules; a package entry covers its modules
    exact: tuple[str, ...]  # modules named through one of their attributes: only themselves
    forbidden: tuple[str, ...]
    importers: tuple[str, ...] | None  # "Imported by ... only"


def _names(text: str) -> list[str]:
    return [n for n in _QUOTED.findall(text) if n.split(".")[0] in ("agent", "submit")]


def import_rules() -> list[ImportRule]:
    """Every package's "May import" paragraph, read."""
    rules = []
    for package, init in _packages().items():
        doc = _package_docstring(init)
        if doc is None or "May import" not in doc.text:
            continue
        paragraph = doc.text[doc.text.index("May import") :].split("\n\n")[0]
        line = doc.line + doc.text[: doc.text.index("May import")].count("\n")
        cut = re.search(r"\b([Nn]ever|nothing|[Ii]mported by)\b", paragraph)
        may = paragraph[: cut.start()] if cut else paragraph
        rest = paragraph[cut.start() :] if cut else ""
        importers_match = re.search(r"[Ii]mported by (.*?) only", rest, re.S)
        forbidden_text = re.sub(r"[Ii]mported by .*?(only|\.)", "", rest, flags=re.S)
        allowed: list[str] = []
        exact: list[str] = []
        for name in _names(may):
            resolved = resolve(name)
            module, attribute = resolved if resolved else (name, None)
            (exact if attribute else allowed).append(module)
        rules.append(
            ImportRule(
                package=package,
                where=_where(init, line),
                allowed=tuple(allowed),
                exact=tuple(exact),
                forbidden=tuple(_names(forbidden_text)),
                importers=tuple(_names(importers_match.group(1))) if importers_match else None,
            )
        )
    return rules


def _within(module: str, scope: str) -> bool:
    return module == scope or module.startswith(scope + ".")


def _layer(module: str) -> int:
    return LAYERS[max((p for p in LAYERS if _within(module, p)), key=len)]


def _named_problems(rule: ImportRule) -> list[str]:
    """What the line names that does not exist, sits above the package, or is forbidden."""
    problems = []
    here = _layer(rule.package)
    for name in (*rule.allowed, *rule.exact):
        if _module_file(name) is None:
            problems.append(f"names {name}, which does not exist")
        elif _layer(name) > here and not _within(name, rule.package):
            problems.append(f"allows {name} (layer {_layer(name)}), above its layer {here}")
        for scope, banned in FORBIDDEN.items():
            if _within(rule.package, scope) and any(_within(name, b) for b in banned):
                problems.append(f"allows {name}, which tests/test_layers.py forbids it")
    return problems


def _import_problems(rule: ImportRule) -> list[str]:
    """What the package's modules import that the line does not allow."""
    problems = []
    inside = [m for m in GRAPH if _within(m, rule.package)]
    for module in inside:
        for target in GRAPH[module]:
            if _within(target, rule.package):
                continue
            covered = any(_within(target, a) for a in rule.allowed) or target in rule.exact
            # A name after "never" or "nothing" forbids what the line did not allow before it
            # ("... and ``agent.web``; nothing else of ``agent``").
            if not covered and any(_within(target, f) for f in rule.forbidden):
                problems.append(f"forbids {target}, which {module} imports")
            elif not covered:
                problems.append(f"does not list {target}, which {module} imports")
    return problems


def _importer_problems(rule: ImportRule) -> list[str]:
    """Who imports the package although the line says only its named importers do."""
    if rule.importers is None:
        return []
    problems = []
    for module, targets in GRAPH.items():
        if _within(module, rule.package) or not any(_within(t, rule.package) for t in targets):
            continue
        if not any(_within(module, i) for i in rule.importers):
            problems.append(
                f"says it is imported by {', '.join(rule.importers)} only, but {module} imports it"
            )
    return problems


def rule_problems(rule: ImportRule) -> list[str]:
    """How a package's "May import" paragraph disagrees with the table and with the code."""
    problems = [*_named_problems(rule), *_import_problems(rule), *_importer_problems(rule)]
    return [f"{rule.where}: {rule.package}'s 'May import' line {p}" for p in problems]


# ---- the tests -----------------------------------------------------------------------------


def test_the_reader_sees_references() -> None:
    """The readers find what they look for (a map test that reads nothing passes anything)."""
    texts = _texts()
    assert any(t.path.name == "ARCHITECTURE.md" for t in texts)
    assert len([1 for _ in architecture_tree()]) > 50
    assert {r.package for r in import_rules()} >= {"agent.job", "agent.node", "agent.head"}
    planted = (
        Text(
            ROOT / "agent/node/x.py",
            3,
            "see agent/node/gone.py and ``agent.node.nowhere``\n"
            "``agent.job.paths.NoSuchName`` and agent.job.paths.JobDir and agent/job/ are fine",
        ),
    )
    assert stale_references(planted) == [
        "agent/node/x.py:3: agent/node/gone.py does not exist",
        "agent/node/x.py:3: agent.node.nowhere does not exist",
        "agent/node/x.py:4: agent.job.paths.NoSuchName does not exist",
    ]


def test_every_named_module_exists() -> None:
    stale = stale_references(_texts()) + stale_tree_entries() + stale_bullets()
    assert not stale, "stale references (fix the text or the name):\n" + "\n".join(stale)


def test_every_module_is_on_the_map() -> None:
    missing = unmapped_modules()
    assert not missing, "modules nobody can find:\n" + "\n".join(missing)


def test_may_import_lines_agree_with_the_layers_and_the_code() -> None:
    problems = [p for rule in import_rules() for p in rule_problems(rule)]
    assert not problems, "wrong 'May import' lines:\n" + "\n".join(problems)
