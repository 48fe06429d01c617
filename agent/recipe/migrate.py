"""A schema-1 TileRT recipe written as schema 2 (``tilert-submit migrate``), comments kept.

The tree is ``agent.recipe.schema1.translate``'s, so the migrated file plans exactly the job the
schema-1 file plans (tests compare their ``plan.json``). YAML libraries drop comments; here they
are carried by hand: a comment block above a schema-1 key, or at the end of its line, goes above
the schema-2 key that key became (``Origins``); a comment whose key has no schema-2 counterpart
(``dynamo``, or a key that became several) goes to the top of the file, naming its key. Anchors
and aliases are written out in full.
"""

from __future__ import annotations

import re

import msgspec
import yaml

from agent.problems import InputError, Problem, error, errors_of
from agent.recipe.schema1 import Origins, is_schema1, translate
from agent.recipe.typedyaml import YamlSyntaxError, line_of, parse, yaml_problem

_HEADER = (
    "# Migrated to srtctl schema 2 by `tilert-submit migrate` from {source}\n"
    '# (srtctl schema 1, backend.type: tilert); docs/recipe.md, "recipes from srtctl 2.x and '
    'InferenceX".\n'
)
# A full-line comment, and a comment after a value ("key: value  # why").
_FULL = re.compile(r"^\s*#")
_KEY_LINE = re.compile(r"^(\s*)(?:- )?[^\s#]")


class _Dumper(yaml.SafeDumper):
    """Block style; multi-line strings (a benchmark command) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def migrate_text(text: str, source: str) -> str:
    """The schema-2 YAML of a schema-1 recipe text; InputError when it is not one or cannot be."""
    try:
        raw, lines, problems = parse(text)
    except YamlSyntaxError as exc:
        raise InputError([yaml_problem(exc)], source) from None
    if not is_schema1(raw):
        raise InputError(
            [
                error(
                    "backend.type",
                    "not a srtctl schema-1 TileRT recipe (backend.type: tilert); nothing to "
                    "migrate",
                    "schema-2 recipes are read as they are; other schema-1 backends: srtctl "
                    "migrate",
                )
            ],
            source,
        )
    tree, origins = translate(raw)
    refused = errors_of([*problems, *origins.problems])
    if refused:
        raise InputError([p if p.line is not None else _at(p, lines) for p in refused], source)
    body = yaml.dump(
        tree,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    return _with_comments(text, lines, body, origins, source)


def _at(problem: Problem, lines: dict[str, int]) -> Problem:
    return msgspec.structs.replace(problem, line=line_of(problem.path, lines))


def _block_lines(text: str) -> set[int]:
    """1-based lines inside block scalars (``|``, ``>``): a ``#`` there is content."""
    inside: set[int] = set()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return inside
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.ScalarNode):
            if node.style in ("|", ">"):
                inside.update(range(node.start_mark.line + 2, node.end_mark.line + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.extend((key, value))
    return inside


def _trailing(line: str) -> str | None:
    """The comment at the end of a line of YAML, outside quotes; None without one."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and i > 0 and line[i - 1] in " \t":
            return line[i:].strip()
    return None


def _comments(text: str) -> tuple[list[str], dict[int, list[str]]]:
    """(the file's header comments, comments by the 1-based line of the key they describe)."""
    blocks = _block_lines(text)
    header: list[str] = []
    found: dict[int, list[str]] = {}
    pending: list[str] = []
    seen_key = False
    for number, line in enumerate(text.splitlines(), 1):
        if number in blocks:
            continue
        if _FULL.match(line):
            pending.append(line.strip())
            continue
        if not line.strip():
            if pending and not seen_key:
                header += [*pending, ""]
                pending = []
            continue
        seen_key = True
        tail = _trailing(line)
        notes = [*pending, *([tail] if tail else [])]
        if notes:
            found[number] = notes
        pending = []
    if pending:
        header += pending
    return header, found


def _with_comments(
    text: str, lines: dict[str, int], body: str, origins: Origins, source: str
) -> str:
    header, by_line = _comments(text)
    old_at = {line: path for path, line in sorted(lines.items(), key=lambda i: -len(i[0]))}
    _, new_lines, _ = parse(body)
    placed: dict[int, list[str]] = {}
    used: set[int] = set()
    for new_path, new_line in sorted(new_lines.items(), key=lambda i: i[1]):
        old_line = lines.get(origins.old(new_path))
        if old_line is None or old_line in used or old_line not in by_line:
            continue
        used.add(old_line)
        placed.setdefault(new_line, []).extend(by_line[old_line])
    left = [
        f"# ({old_at.get(line, '?')}) {note.lstrip('#').strip()}"
        for line, notes in sorted(by_line.items())
        if line not in used
        for note in notes
    ]
    out = [_HEADER.format(source=source)]
    if header:
        out.append("\n".join(header).rstrip("\n") + "\n")
    if left:
        out.append("# Comments of schema-1 keys that have no schema-2 key of their own:\n")
        out.append("\n".join(left) + "\n")
    for number, line in enumerate(body.splitlines(), 1):
        indent = _KEY_LINE.match(line)
        pad = indent.group(1) if indent else ""
        out.extend(f"{pad}{note}\n" for note in placed.get(number, []))
        out.append(line + "\n")
    return "".join(out)
