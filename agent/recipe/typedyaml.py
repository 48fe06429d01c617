"""Typed YAML for recipes and cluster files: parse with line numbers, then check the whole tree.

msgspec stops at the first problem; users fixing a recipe on a login node want all of them. So the
raw tree is walked against the msgspec type (``msgspec.inspect``): every unknown key (with a
"did you mean") and every wrong type is reported, and the offending entries are pruned so that
``msgspec.convert`` succeeds and the load-time rules can still run on the rest.

The YAML dialect is YAML 1.1 as PyYAML reads it, minus two traps: base-60 numbers
(``time_limit: 4:00:00`` would become the integer 14400) and leading-zero octals (``0755`` would
become 493) stay strings, as in YAML 1.2. Duplicate keys, which PyYAML silently collapses, are
errors.

Bounded: a document nests at most ``MAX_DEPTH`` levels and expands to at most ``MAX_NODES`` nodes
(aliases counted at every use, so an alias bomb is refused while it is composed, in milliseconds,
before anything walks the exponential tree it stands for); an alias inside its own anchor is
refused. Every number is finite and within the range its field declares (``msgspec.Meta`` on the
model), every string and key free of control characters: a NUL cannot pass through argv or the
environment, and an escape sequence in a value would reach every log that quotes it.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec
import msgspec.inspect as mi
import yaml

from agent.errors import BadInput
from agent.problems import Problem, error

# A key path in a YAML tree, ("roles", "decode", "env", 0); not named Path, which is pathlib's.
KeyPart = str | int
KeyPath = tuple[KeyPart, ...]

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"


# A recipe nests 6 levels deep and has a few hundred nodes.
MAX_DEPTH = 32
MAX_NODES = 100_000
# Longer integer literals are a mistake (and past 4300 digits int() itself refuses).
_MAX_INT_DIGITS = 64


class _LimitError(yaml.MarkedYAMLError):
    """A document over one of the bounds (not a syntax error: its hint differs)."""


class _Loader(yaml.SafeLoader):
    """SafeLoader without base-60 numbers and leading-zero octals, with depth and size bounds."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        # Expanded size of every node composed so far (aliases count their anchor's whole size).
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        """The next node, refused when it nests too deep, expands too far or contains itself."""
        # The stubs leave peek_event untyped: the next event, not consumed.
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]
        # The pure-Python loader's marks (the stubs also allow libyaml's).
        mark = cast(yaml.error.Mark | None, event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            target = self.anchors.get(anchor)
            if target is not None and id(target) not in self._sizes:
                raise _LimitError(
                    None, None, f"alias *{anchor} is used inside its own anchor &{anchor}", mark
                )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _LimitError(None, None, f"nesting deeper than {MAX_DEPTH} levels", mark)
            node = super().compose_node(parent, index)  # type: ignore[arg-type]
        finally:
            self._depth -= 1
        if node is None:
            return None
        size = self._sizes.get(id(node))
        if size is None:
            size = 1
            if isinstance(node, yaml.SequenceNode):
                size += sum(self._sizes[id(item)] for item in node.value)
            elif isinstance(node, yaml.MappingNode):
                size += sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
            self._sizes[id(node)] = size
        if size > MAX_NODES:
            raise _LimitError(
                None,
                None,
                f"the document expands to more than {MAX_NODES} values "
                "(aliases count at every use)",
                mark,
            )
        return node


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0o[0-7_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    if len(text) > _MAX_INT_DIGITS:
        raise _LimitError(
            None, None, f"an integer of more than {_MAX_INT_DIGITS} digits", node.start_mark
        )
    if text.lstrip("+-").startswith("0o"):
        sign = -1 if text.startswith("-") else 1
        return sign * int(text.lstrip("+-")[2:], 8)
    return int(text, 0)


_Loader.add_constructor(_INT, _construct_int)


SYNTAX_HINT = (
    "check indentation (spaces, not tabs), colons after keys, and quote values that contain "
    "': ' or start with a special character"
)
LIMIT_HINT = "a recipe or cluster file is a few KB of plain YAML: check that this is the right file"
TEXT_HINT = "remove it: the file must be plain UTF-8 text (is it binary or damaged?)"


class YamlSyntaxError(BadInput):
    """YAML that does not parse (or is over a bound); ``line``/``column`` are 1-based when known."""

    def __init__(
        self,
        detail: str,
        line: int | None,
        column: int | None,
        *,
        message: str | None = None,
        hint: str = SYNTAX_HINT,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.line = line
        self.column = column
        where = f" (line {line}, column {column})" if line else ""
        # What the user reads: "YAML syntax error: ..." unless the file broke a bound.
        self.message = message or f"YAML syntax error: {detail}{where}"
        self.hint = hint


def yaml_problem(exc: YamlSyntaxError) -> Problem:
    """The problem a file that does not parse is reported as (recipe and cluster file alike)."""
    return error("", exc.message, exc.hint, exc.line)


def dotted(path: KeyPath) -> str:
    """``("roles", "decode", "env", 0)`` -> ``roles.decode.env[0]``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            part = part or '""'  # an empty key still names a place
            text += f".{part}" if text else part
    return text


def _reader_error(exc: yaml.reader.ReaderError, text: str) -> YamlSyntaxError:
    """PyYAML's refusal of the raw text (a control character: often a binary file)."""
    line = text.count("\n", 0, exc.position) + 1
    column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
    detail = f"control character {chr(exc.character)!r} at line {line}, column {column}"
    return YamlSyntaxError(
        detail, line, column, message=f"the file contains a {detail}", hint=TEXT_HINT
    )


def _syntax_error(exc: yaml.YAMLError, text: str) -> YamlSyntaxError:
    if isinstance(exc, yaml.reader.ReaderError):
        return _reader_error(exc, text)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    detail = " ".join(
        str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part
    ) or str(exc)
    line: int | None = mark.line + 1 if mark is not None else None
    column: int | None = mark.column + 1 if mark is not None else None
    if isinstance(exc, _LimitError):
        where = f" (line {line}, column {column})" if line else ""
        return YamlSyntaxError(
            detail, line, column, message=f"refused: {detail}{where}", hint=LIMIT_HINT
        )
    return YamlSyntaxError(detail, line, column)


def _walk_nodes(node: yaml.Node, path: KeyPath, lines: dict[str, int], dups: list[Problem]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = (*path, key)
            line = key_node.start_mark.line + 1
            if key in seen and key != "<<":
                dups.append(
                    error(
                        dotted(child),
                        f"duplicate key '{key}' (YAML keeps only the last one)",
                        "write each key once",
                        line,
                    )
                )
            seen.add(key)
            lines.setdefault(dotted(child), line)
            _walk_nodes(value_node, child, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*path, index)
            lines.setdefault(dotted(child), item.start_mark.line + 1)
            _walk_nodes(item, child, lines, dups)


def parse(text: str) -> tuple[Any, dict[str, int], list[Problem]]:
    """Parse YAML: (data, dotted key path -> line, duplicate-key problems); YamlSyntaxError."""
    try:
        loader = _Loader(text)
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, text) from None
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        dups: list[Problem] = []
        if node is None:
            return None, lines, dups
        _walk_nodes(node, (), lines, dups)
        return loader.construct_document(node), lines, dups
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, text) from None
    except (ValueError, OverflowError) as exc:  # an explicit tag on a wrong value: !!int abc
        raise YamlSyntaxError(f"a value cannot be read: {exc}", None, None) from None
    finally:
        loader.dispose()


def load_scalar(text: str) -> Any:
    """One YAML value typed exactly as in a recipe file (for ``--set``)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, text) from None
    except (ValueError, OverflowError) as exc:
        raise YamlSyntaxError(f"a value cannot be read: {exc}", None, None) from None


def line_of(path: str, lines: Mapping[str, int]) -> int | None:
    """Line of ``path`` or of its nearest ancestor present in the file."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        if cut <= 0:
            return None
        path = path[:cut]
    return None


# ---- shape checking ---------------------------------------------------------------------------

_NONE = mi.NoneType

# NUL cannot pass through argv or the environment; the other C0 controls, DEL and the C1 controls
# (terminal escape sequences) are an accident or an attack on whoever reads a log that quotes them.
# Values may hold tabs and newlines (a JSON block scalar); keys and names nothing of the kind.
_CONTROL_IN_VALUE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_IN_KEY = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_PLAIN_KEYS = (str, int, float, bool, type(None))
# A message quotes at most this much of a value.
_QUOTE_CHARS = 60


def describe(t: mi.Type) -> str:
    """The expected type in words ("an integer", "a mapping", "true or false")."""
    if isinstance(t, mi.UnionType):
        names = list(dict.fromkeys(describe(m) for m in t.types if not isinstance(m, _NONE)))
        if "a number" in names and "an integer" in names:
            names.remove("an integer")
        if len(names) > 2:
            return ", ".join(names[:-1]) + " or " + names[-1]
        return " or ".join(names) or "null"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    return {
        mi.StrType: "a string",
        mi.IntType: "an integer",
        mi.FloatType: "a number",
        mi.BoolType: "true or false",
        mi.NoneType: "null",
        mi.DictType: "a mapping",
        mi.StructType: "a mapping",
        mi.ListType: "a list",
        mi.AnyType: "any value",
    }.get(type(t), "a valid value")


def _what(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        if len(value) > _QUOTE_CHARS:
            return f"the string {value[:_QUOTE_CHARS]!r}... ({len(value)} characters)"
        return f"the string {value!r}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _kind_ok(value: Any, t: mi.Type) -> bool:
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.UnionType):
        return any(_kind_ok(value, m) for m in t.types)
    if isinstance(t, mi.LiteralType):
        return value in t.values and not isinstance(value, bool)
    if isinstance(t, mi.StrType):
        return isinstance(value, str)
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, mi.DictType | mi.StructType):
        return isinstance(value, dict)
    if isinstance(t, mi.ListType):
        return isinstance(value, list)
    return True


def _type_hint(t: mi.Type, path: KeyPath) -> str:
    want = describe(t)
    key = str(path[-1]) if path else "the file"
    if want.startswith("an integer"):
        return f"write a whole number without quotes, e.g. {key}: 2"
    if want.startswith("a number"):
        return f"write a number without quotes, e.g. {key}: 1.5"
    if want == "true or false":
        return f"write {key}: true or {key}: false"
    if want.startswith("a string"):
        return f'quote the value, e.g. {key}: "..."'
    if want.startswith("a mapping"):
        return f"write indented 'name: value' pairs under {key}"
    if want.startswith("a list"):
        return f"write a YAML list under {key}, one '- item' per line"
    return f"use {want}"


# Extra advice for an unknown key: (struct class, key, path) -> a message and a hint, or None.
UnknownKeyAdvice = Callable[[type, str, KeyPath], tuple[str, str] | None]


def suggest(word: str, choices: list[str]) -> str | None:
    """The closest choice to ``word`` (``_`` and ``-`` treated alike), or None."""
    norm = {c.replace("-", "_").lower(): c for c in choices}
    exact = norm.get(word.replace("-", "_").lower())
    if exact is not None:
        return exact
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def _number(x: float) -> str:
    """``65535``, ``0.05``: a bound or a value as a user would write it."""
    if isinstance(x, int) or not float(x).is_integer():
        return str(x)
    return str(int(x))


def _range(t: mi.IntType | mi.FloatType) -> str:
    """A numeric field's range in words ("from 1 to 65535", "greater than 0 and at most 60")."""
    if t.ge is not None and t.le is not None:
        return f"from {_number(t.ge)} to {_number(t.le)}"
    parts = []
    for bound, words in (
        (t.ge, "at least"),
        (t.gt, "greater than"),
        (t.le, "at most"),
        (t.lt, "less than"),
    ):
        if bound is not None:
            parts.append(f"{words} {_number(bound)}")
    return " and ".join(parts)


def _in_range(value: float, t: mi.IntType | mi.FloatType) -> bool:
    return not (
        (t.ge is not None and value < t.ge)
        or (t.gt is not None and value <= t.gt)
        or (t.le is not None and value > t.le)
        or (t.lt is not None and value >= t.lt)
    )


class ShapeChecker:
    """Walks a raw YAML tree against a msgspec type; collects problems and prunes what is wrong."""

    def __init__(self, advice: UnknownKeyAdvice | None = None) -> None:
        self.problems: list[Problem] = []
        # Dotted paths removed from the tree; rule problems under them are noise.
        self.pruned: list[str] = []
        self._advice = advice

    def _bad(self, path: KeyPath, message: str, hint: str) -> None:
        self.problems.append(error(dotted(path), message, hint))
        self.pruned.append(dotted(path))

    def check(
        self, value: Any, t: mi.Type, path: KeyPath = (), default: Any = msgspec.NODEFAULT
    ) -> tuple[bool, Any]:
        """(keep, cleaned value): ``keep`` is False when the value itself is wrong.

        ``default`` is the field's default, named in the hint of an out-of-range value.
        """
        if isinstance(t, mi.UnionType):
            members = [m for m in t.types if _kind_ok(value, m)]
            if not members:
                self._bad(path, f"expected {describe(t)}, got {_what(value)}", _type_hint(t, path))
                return False, None
            # A dict value goes to the Struct/Dict member; anything else to its scalar member.
            return self.check(value, members[0], path, default)
        if isinstance(t, mi.AnyType):
            if self._plain(value, path):
                return True, value
            self.pruned.append(dotted(path))  # the whole value goes: no follow-up noise about it
            return False, None
        if isinstance(t, mi.StructType):
            if not isinstance(value, dict):
                self._bad(path, f"expected a mapping, got {_what(value)}", _type_hint(t, path))
                return False, None
            return True, self._struct(value, t, path)
        if isinstance(t, mi.DictType):
            return self._dict(value, t, path)
        if isinstance(t, mi.ListType):
            return self._list(value, t, path)
        return self._scalar(value, t, path, default)

    def _dict(self, value: Any, t: mi.DictType, path: KeyPath) -> tuple[bool, Any]:
        """A mapping of free keys: each key checked, each value against the value type."""
        if not isinstance(value, dict):
            self._bad(path, f"expected a mapping, got {_what(value)}", _type_hint(t, path))
            return False, None
        cleaned: dict[Any, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                self._bad((*path, str(key)), "keys must be strings", f'quote it: "{key}"')
                continue
            if not self._key_ok(key, (*path, key)):
                continue
            keep, item = self.check(item, t.value_type, (*path, key))
            if keep:
                cleaned[key] = item
        return True, cleaned

    def _list(self, value: Any, t: mi.ListType, path: KeyPath) -> tuple[bool, Any]:
        """A list: each item against the item type, wrong ones pruned."""
        if not isinstance(value, list):
            self._bad(path, f"expected a list, got {_what(value)}", _type_hint(t, path))
            return False, None
        items = []
        for index, item in enumerate(value):
            keep, item = self.check(item, t.item_type, (*path, index))
            if keep:
                items.append(item)
        return True, items

    def _scalar(self, value: Any, t: mi.Type, path: KeyPath, default: Any) -> tuple[bool, Any]:
        """A string, number or flag: its kind, then its text or range."""
        if not _kind_ok(value, t):
            self._bad(path, f"expected {describe(t)}, got {_what(value)}", _type_hint(t, path))
            return False, None
        if isinstance(value, str):
            return self._text_ok(value, path), value
        if isinstance(t, mi.IntType | mi.FloatType) and not isinstance(value, bool):
            return self._number_ok(value, t, path, default), value
        return True, value

    def _text_ok(self, value: str, path: KeyPath) -> bool:
        bad = _CONTROL_IN_VALUE.search(value)
        if bad is None:
            return True
        self._bad(
            path,
            f"contains the control character {bad.group()!r} at position {bad.start() + 1}",
            "remove it (tab and newline are the only control characters a value may hold)",
        )
        return False

    def _key_ok(self, key: str, path: KeyPath) -> bool:
        bad = _CONTROL_IN_KEY.search(key)
        if bad is None and key:
            return True
        message = (
            f"the key contains the control character {bad.group()!r}" if bad else "the key is empty"
        )
        self._bad(path, message, "write a name of printable characters")
        return False

    def _number_ok(
        self, value: float, t: mi.IntType | mi.FloatType, path: KeyPath, default: Any
    ) -> bool:
        finite = math.isfinite(value)
        if finite and _in_range(value, t):
            return True
        hint = f"write a number {_range(t)}" if _range(t) else "write a finite number"
        if default is not msgspec.NODEFAULT and default is not None:
            hint += f", or remove it to use the default ({_number(default)})"
        if not finite:
            self._bad(path, f"expected a finite number, got {_what(value)}", hint)
        else:
            self._bad(path, f"{_number(value)} is out of range: it must be {_range(t)}", hint)
        return False

    def _plain(self, value: Any, path: KeyPath) -> bool:
        """Whether a free-form value (engine args) is plain data: what JSON and argv can carry."""
        if isinstance(value, str):
            return self._text_ok(value, path)
        if isinstance(value, float):
            if math.isfinite(value):
                return True
            self._bad(
                path,
                f"expected a finite number, got {_what(value)}",
                'quote it if the engine takes it as text: "inf"',
            )
            return False
        if value is None or isinstance(value, bool | int):
            return True
        if isinstance(value, list):
            return all([self._plain(item, (*path, i)) for i, item in enumerate(value)])
        if isinstance(value, dict):
            ok = True
            for key, item in value.items():
                child = (*path, str(key))
                if not isinstance(key, _PLAIN_KEYS) or (
                    isinstance(key, float) and not math.isfinite(key)
                ):
                    self._bad(child, f"a key cannot be {_what(key)}", "write the key as a string")
                    ok = False
                elif (isinstance(key, str) and not self._key_ok(key, child)) or not self._plain(
                    item, child
                ):
                    ok = False
            return ok
        self._bad(
            path,
            f"expected a string, number, true/false, null, list or mapping, got {_what(value)}",
            'quote the value: "..."',
        )
        return False

    def _struct(self, value: dict[Any, Any], t: mi.StructType, path: KeyPath) -> dict[str, Any]:
        fields = {f.encode_name: f for f in t.fields}
        cleaned: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                self._bad((*path, str(key)), "keys must be strings", f'quote it: "{key}"')
                continue
            field = fields.get(key)
            if field is None:
                self._unknown(key, t, path, list(fields))
                continue
            keep, item = self.check(item, field.type, (*path, key), field.default)
            if keep:
                cleaned[key] = item
        for name, field in fields.items():
            if field.required and name not in value:
                self._bad((*path, name), f"'{name}' is required here", f"add {name}: ...")
        return cleaned

    def _unknown(self, key: str, t: mi.StructType, path: KeyPath, choices: list[str]) -> None:
        advice = self._advice(t.cls, key, path) if self._advice else None
        if advice is not None:
            message, hint = advice
        else:
            message = f"unknown key '{key}'"
            close = suggest(key, choices)
            where = dotted(path) or "the top level"
            if close is not None:
                hint = f"did you mean '{close}'?"
            else:
                hint = f"keys allowed under {where}: {', '.join(choices)}"
        self._bad((*path, key), message, hint)


def convert_problem(exc: msgspec.ValidationError) -> Problem:
    """A Problem from msgspec's own message (only reached if the walker missed something)."""
    text = str(exc)
    path = ""
    if " - at `$" in text:
        text, _, where = text.partition(" - at `$")
        path = where.rstrip("`").lstrip(".")
    return error(path, text, "fix the value's type")
