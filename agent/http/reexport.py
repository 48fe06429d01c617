"""vLLM's /metrics re-served by the prefill agent, with ``role``, ``node`` and ``slurm_job_id``
added.

A strict line-based relabeller, not prometheus_client's parser: that parser folds ``X_total`` into
family ``X``, splits ``X_created`` off and is lenient about what it accepts, so a page it accepted
could still come out invalid. Here every line is checked against the classic text format (0.0.4)
as promtool reads it, the page is grouped into families, and it is rendered again in canonical
form: HELP (re-escaped), TYPE, the family's samples, every label value re-escaped. A page with any
defect (a bad line, junk bytes, a duplicate HELP/TYPE/series, a histogram without ``+Inf``, a
truncated last line) is rejected whole, because a partial page would hide series silently while
claiming the upstream is fine; the caller reports ``up = False`` and ``last_error`` instead.

Speed: a line as exporters write it is read by one regex (``_PLAIN_SAMPLE``; any other line by the
exact reader), and ``Relabeller`` relabels a page that has the last accepted page's lines but for
sample values by cutting and joining: vLLM's next scrape differs in its values only
(docs/performance.md).

Label rules: ``job`` and ``instance`` belong to Prometheus and the added labels are ours, so an
upstream label with one of those names is kept as ``upstream_<name>`` (more ``upstream_`` prefixes
if that name is taken too). Upstream ``process_*``, ``python_*`` and ``http_*`` families describe
only vLLM's API process and clash with any Python exporter's own, so they are dropped; so is any
family that would collide with a name the agent's own registry serves.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain

from prometheus_client.registry import Collector

from agent.errors import RuntimeFailure

ACCEPT = "text/plain; version=0.0.4"
DROP_PREFIXES = ("process_", "python_", "http_")
PROMETHEUS_LABELS = (
    "job",
    "instance",
)  # Prometheus sets these; a page carrying them gets exported_*
RENAME_PREFIX = "upstream_"
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
# Names a family can occupy in some parser's view: client_python folds X_total/X_created into X
# and OpenMetrics adds _created/_info/_gsum/_gcount, so reserved names are widened by these.
_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count", "_info", "_gsum", "_gcount")
_SERIES_LABELS = {"histogram": "le", "summary": "quantile"}

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LABEL_VALUE = re.compile(r'((?:[^"\\]|\\.)*)"')
_FLOAT = re.compile(r"[+-]?Inf|NaN|[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_TIMESTAMP = re.compile(r"-?[0-9]{1,19}")
_BLANKS = " \t"
# NUL and other C0 controls never occur in a real page; tab is a separator, newline ends lines.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ESCAPE = re.compile(r"\\(.)")
# A sample line as exporters write it: no blank but the one before the value (and the
# timestamp), label values without escapes, at most a trailing comma. One regex reads it, and
# _parse_sample would read it the same way; any other line is _parse_sample's.
_PLAIN_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_PLAIN_SAMPLE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{(?:({_PLAIN_PAIR}(?:,{_PLAIN_PAIR})*),?)?\}})?"
    r" ([^ \t]+)(?: (-?[0-9]{1,18}))?"
)
_PLAIN_PAIRS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
# A value _is_float takes that cannot overflow (at most 200 integer digits, a 2-digit exponent).
_PLAIN_VALUE_RE = (
    r"[+-]?Inf|NaN|[+-]?(?:[0-9]{1,200}(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,2})?"
)
_PLAIN_VALUE = re.compile(_PLAIN_VALUE_RE)
_PLAIN_VALUES = re.compile(rf"(?:(?:{_PLAIN_VALUE_RE})(?:\n(?:{_PLAIN_VALUE_RE}))*)?")
# The last token of each line that has a blank (Relabeller's cut).
_LAST_TOKEN = re.compile(r" ([^ \n]*)\n")
_LABEL_UNESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_HELP_UNESCAPES = {"\\": "\\", "n": "\n"}


class PageError(RuntimeFailure, ValueError):
    """A page that is not valid classic exposition text (the message names the line)."""


@dataclass(slots=True)
class _Sample:
    name: str
    labels: list[tuple[str, str]]
    value: str
    timestamp: str | None
    line: int
    # The labels as the page wrote them, when that is already how they are printed, else None.
    text: str | None = None


@dataclass
class _Family:
    name: str
    line: int
    type: str | None = None
    help: str | None = None
    samples: list[_Sample] = field(default_factory=list)

    def sample_names(self) -> set[str]:
        """Sample names that belong to this family in the classic format."""
        kind = self.type or "untyped"
        if kind == "histogram":
            return {self.name + s for s in ("_bucket", "_sum", "_count")}
        if kind == "summary":
            return {self.name, self.name + "_sum", self.name + "_count"}
        return {self.name}

    def occupied(self) -> set[str]:
        """Every name this family takes in promtool's or client_python's view of the page."""
        names = self.sample_names() | {self.name}
        if self.type == "counter" and self.name.endswith("_total"):
            names.add(self.name.removesuffix("_total"))
        return names


def relabel_page(
    page: str,
    labels: Mapping[str, str],
    *,
    drop_prefixes: Iterable[str] = DROP_PREFIXES,
    reserved_names: Collection[str] = (),
) -> str:
    """``page`` (classic text) re-rendered with ``labels`` on every sample; raises PageError."""
    check_labels(labels)
    families = _parse(page)
    chunks, _ = _render(families, labels, tuple(drop_prefixes), widen_names(reserved_names))
    return "".join(chunks)


def _render(
    families: list[_Family],
    labels: Mapping[str, str],
    prefixes: tuple[str, ...],
    reserved: set[str],
) -> tuple[list[str], list[tuple[int, _Sample]]]:
    """The output in chunks, each sample's value a chunk of its own; (its chunk index, sample)."""
    added = ",".join(f'{name}="{_escape_label(value)}"' for name, value in labels.items())
    taken_by_us = set(PROMETHEUS_LABELS) | set(labels)
    ours = re.compile("(?:^|,)(?:" + "|".join(map(re.escape, sorted(taken_by_us))) + ')="')
    out: list[str] = []
    values: list[tuple[int, _Sample]] = []
    for family in families:
        if family.name.startswith(prefixes) or family.occupied() & reserved:
            continue
        if family.help is not None:
            out.append(f"# HELP {family.name} {_escape_help(family.help)}\n")
        out.append(f"# TYPE {family.name} {family.type or 'untyped'}\n")
        for sample in family.samples:
            text = sample.text
            if text is None or ours.search(text):
                pairs = _rename_ours(sample.labels, taken_by_us)
                text = ",".join(f'{n}="{_escape_label(v)}"' for n, v in pairs)
            text = f"{text},{added}" if text and added else text or added
            out.append(f"{sample.name}{{{text}}} " if text else f"{sample.name} ")
            values.append((len(out), sample))
            out.append(sample.value)
            out.append(f" {sample.timestamp}\n" if sample.timestamp is not None else "\n")
    return out, values


@dataclass(frozen=True)
class _Shape:
    """A page cut at the last blank of each line: what must stay the same for the next page to be
    relabelled by its values alone, and where each value goes in the output."""

    pieces: list[str]  # the page without those last tokens
    fixed: list[int]  # tokens that are not a sample's value (HELP words, timestamps, ...)
    fixed_tokens: list[str]  # ... and what they were
    valued: list[int]  # tokens that are a sample's value (each checked on every page)
    out_text: list[str]  # the output before each value it shows ...
    out_values: list[int]  # ... which token that value is
    out_tail: str

    def fill(self, page: str) -> str | None:
        """The output for ``page`` if it has this shape and every value is a float, else None."""
        parts = _LAST_TOKEN.split(page)
        if parts[0::2] != self.pieces:
            return None
        tokens = parts[1::2]
        if [tokens[i] for i in self.fixed] != self.fixed_tokens:
            return None
        if not _PLAIN_VALUES.fullmatch("\n".join([tokens[i] for i in self.valued])):
            return None
        values = [tokens[i] for i in self.out_values]
        return "".join(chain.from_iterable(zip(self.out_text, values, strict=True))) + self.out_tail


def _shape(
    page: str, chunks: list[str], values: list[tuple[int, _Sample]], samples: list[_Sample]
) -> _Shape:
    """The shape of an accepted ``page`` rendered as ``chunks``."""
    parts = _LAST_TOKEN.split(page)
    tokens = parts[1::2]
    token_of_line: dict[int, int] = {}
    for lineno, line in enumerate(page[:-1].split("\n"), 1):
        if " " in line:
            token_of_line[lineno] = len(token_of_line)

    def token(sample: _Sample) -> int | None:
        # A value another page may change: the line's last token, with no timestamp after it.
        index = token_of_line.get(sample.line)
        if sample.timestamp is not None or index is None or tokens[index] != sample.value:
            return None
        return index if _PLAIN_VALUE.fullmatch(sample.value) else None

    valued = {index for sample in samples if (index := token(sample)) is not None}
    out_text: list[str] = []
    out_values: list[int] = []
    start = 0
    for chunk, sample in values:
        index = token(sample)
        if index is not None:
            out_text.append("".join(chunks[start:chunk]))
            out_values.append(index)
            start = chunk + 1
    fixed = [i for i in range(len(tokens)) if i not in valued]
    return _Shape(
        pieces=parts[0::2],
        fixed=fixed,
        fixed_tokens=[tokens[i] for i in fixed],
        valued=sorted(valued),
        out_text=out_text,
        out_values=out_values,
        out_tail="".join(chunks[start:]),
    )


class Relabeller:
    """``relabel_page`` for the pages of one exporter, fast for a page shaped like the last one.

    An exporter's pages differ from scrape to scrape in their sample values only, until a new
    series appears. A page that has the last accepted page's lines but for sample values (each
    still a float) passes every check that page passed, and its output is that page's with the
    new values: it is cut and joined, not parsed (a 5,000-line vLLM page in about 2 ms instead of
    about 25). Any other page is parsed whole, and its shape kept for the next.
    """

    def __init__(
        self,
        labels: Mapping[str, str],
        *,
        drop_prefixes: Iterable[str] = DROP_PREFIXES,
        reserved_names: Collection[str] = (),
    ) -> None:
        check_labels(labels)
        self.labels = dict(labels)
        self.prefixes = tuple(drop_prefixes)
        self.reserved_names = frozenset(reserved_names)
        self._reserved = widen_names(reserved_names)
        self._shape: _Shape | None = None

    def relabel(self, page: str) -> str:
        """``relabel_page(page, ...)``; raises PageError."""
        text = self.reuse(page)
        return text if text is not None else self.parse(page)

    def reuse(self, page: str) -> str | None:
        """The output for a page shaped like the last (about 2 ms for 5,000 lines); else None."""
        return self._shape.fill(page) if self._shape is not None else None

    def parse(self, page: str) -> str:
        """``page`` parsed whole and relabelled; its shape is kept for the next. PageError."""
        self._shape = None
        families = _parse(page)
        chunks, values = _render(families, self.labels, self.prefixes, self._reserved)
        samples = [sample for family in families for sample in family.samples]
        self._shape = _shape(page, chunks, values, samples)
        return "".join(chunks)


def check_labels(labels: Mapping[str, str]) -> None:
    """Raise ValueError unless ``labels`` can be added to every sample of any page."""
    for name, value in labels.items():
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a usable Prometheus label name")
        if name in PROMETHEUS_LABELS or name in _SERIES_LABELS.values():
            raise ValueError(f"label {name!r} is owned by Prometheus or by histograms/summaries")
        if not isinstance(value, str):
            raise ValueError(f"label {name!r} must be a string, not {type(value).__name__}")


def widen_names(names: Iterable[str]) -> set[str]:
    """``names`` plus every name a parser could derive from or fold into them."""
    wide: set[str] = set()
    for name in names:
        bases = {name} | {name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)}
        for base in bases:
            wide.add(base)
            wide.update(base + s for s in _SUFFIXES)
    return wide


def registry_names(registry: Collector) -> set[str]:
    """Family and sample names a prometheus_client registry serves (for ``reserved_names``)."""
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def _rename_ours(pairs: list[tuple[str, str]], ours: set[str]) -> list[tuple[str, str]]:
    """Upstream labels with our or Prometheus' names moved to ``upstream_<name>`` (unique)."""
    if not any(name in ours for name, _ in pairs):
        return pairs
    taken = ours | {name for name, _ in pairs}
    renamed = []
    for name, value in pairs:
        if name in ours:
            new = RENAME_PREFIX + name
            while new in taken:
                new = RENAME_PREFIX + new
            taken.add(new)
            name = new
        renamed.append((name, value))
    return renamed


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _unescape(raw: str, table: Mapping[str, str], lineno: int, what: str) -> str:
    if "\\" not in raw:
        return raw

    def one(match: re.Match[str]) -> str:
        if match.group(1) not in table:
            raise PageError(
                f"line {lineno}: invalid escape sequence '\\{match.group(1)}' in {what}"
            )
        return table[match.group(1)]

    if (len(raw) - len(raw.rstrip("\\"))) % 2:
        raise PageError(f"line {lineno}: dangling backslash in {what}")
    return _ESCAPE.sub(one, raw)


def _parse(page: str) -> list[_Family]:
    """Families in page order; every line checked, cross-line rules enforced."""
    if not page:
        return []
    if not page.endswith("\n"):
        raise PageError("the page does not end with a newline (truncated?)")
    lines = page[:-1].split("\n")
    # One search over the page instead of one per line; reported when its line comes up, so
    # the first defect in page order is the one named.
    bad = _CONTROL.search(page, 0, len(page) - 1)
    bad_line = page.count("\n", 0, bad.start()) + 1 if bad else 0
    declared: dict[str, _Family] = {}
    raw_samples: list[_Sample] = []
    plain = _PLAIN_SAMPLE.fullmatch
    for lineno, line in enumerate(lines, 1):
        if lineno == bad_line and bad:
            raise PageError(f"line {lineno}: control character {bad.group()!r}")
        stripped = line.lstrip(_BLANKS)
        if not stripped:
            continue
        if stripped[0] == "#":
            _parse_comment(stripped, lineno, declared)
            continue
        match = plain(stripped)
        sample = _plain_sample(match, lineno) if match else None
        raw_samples.append(sample or _parse_sample(stripped, lineno))
    owner: dict[str, _Family] = {}
    for family in declared.values():
        for name in family.sample_names():
            owner.setdefault(name, family)
    families = list(declared.values())
    for sample in raw_samples:
        found = owner.get(sample.name)
        if found is None:
            if sample.name in declared:
                # `x 1` under `# TYPE x histogram`: rendered as a family of its own it would
                # declare x twice, and Prometheus would refuse the agent's whole page.
                kind = declared[sample.name].type
                raise PageError(
                    f"line {sample.line}: sample {sample.name} does not fit TYPE {kind}"
                )
            found = owner[sample.name] = _Family(sample.name, sample.line)
            families.append(found)
        found.samples.append(sample)
    families.sort(key=lambda f: f.line)
    _check_families(families)
    return families


def _parse_comment(line: str, lineno: int, declared: dict[str, _Family]) -> None:
    """HELP and TYPE lines; any other ``#`` line is a comment (as in promtool)."""
    parts = line[1:].lstrip(_BLANKS).split(None, 1)
    if parts == ["EOF"]:
        # OpenMetrics (prometheus_client's own app at /metrics/): counters lack _total on TYPE
        # lines and bug #1177 turns the colon into _ on sample lines only; refuse, don't guess.
        raise PageError(f"line {lineno}: '# EOF' marks OpenMetrics; ask for {ACCEPT}")
    if not parts or parts[0] not in ("HELP", "TYPE"):
        return
    keyword = parts[0]
    rest = parts[1].lstrip(_BLANKS) if len(parts) > 1 else ""
    match = _NAME.match(rest)
    if not match or (match.end() < len(rest) and rest[match.end()] not in _BLANKS):
        raise PageError(f"line {lineno}: {keyword} without a valid metric name")
    name, text = match.group(), rest[match.end() :].lstrip(_BLANKS)
    family = declared.setdefault(name, _Family(name, lineno))
    if keyword == "HELP":
        if family.help is not None:
            raise PageError(f"line {lineno}: second HELP line for {name}")
        family.help = _unescape(text, _HELP_UNESCAPES, lineno, "HELP")
        return
    kind = text.strip(_BLANKS).lower()
    if kind not in TYPES:
        raise PageError(f"line {lineno}: unknown TYPE {text!r} for {name}")
    if family.type is not None:
        raise PageError(f"line {lineno}: second TYPE line for {name}")
    family.type = kind


def _plain_sample(match: re.Match[str], lineno: int) -> _Sample | None:
    """The sample of a line ``_PLAIN_SAMPLE`` matched; None when ``_parse_sample`` must judge it."""
    name, text, value, stamp = match.groups()
    if not _is_float(value):
        return None
    if not text:
        return _Sample(name, [], value, stamp, lineno, "")
    labels = _PLAIN_PAIRS.findall(text)
    if len(dict(labels)) != len(labels) or text.startswith("__name__=") or ",__name__=" in text:
        return None
    return _Sample(name, labels, value, stamp, lineno, text)


def _parse_sample(line: str, lineno: int) -> _Sample:
    """``name{label="value",...} value [timestamp]``, label values unescaped."""
    match = _NAME.match(line)
    if not match:
        raise PageError(f"line {lineno}: not a sample, HELP, TYPE or comment line")
    name, pos = match.group(), match.end()
    labels: list[tuple[str, str]] = []
    if pos < len(line) and line[pos] == "{":
        pos = _parse_labels(line, pos + 1, lineno, labels)
    elif pos < len(line) and line[pos] not in _BLANKS:
        raise PageError(f"line {lineno}: unexpected {line[pos]!r} after the metric name")
    tokens = line[pos:].split()
    if not 1 <= len(tokens) <= 2:
        raise PageError(f"line {lineno}: expected a value and at most a timestamp after {name}")
    value = tokens[0]
    if not _is_float(value):
        raise PageError(f"line {lineno}: {value!r} is not a float value")
    stamp = tokens[1] if len(tokens) == 2 else None
    if stamp is not None and not (_TIMESTAMP.fullmatch(stamp) and -(2**63) <= int(stamp) < 2**63):
        raise PageError(f"line {lineno}: {stamp!r} is not an integer timestamp")
    return _Sample(name, labels, value, stamp, lineno)


def _skip_blanks(line: str, pos: int) -> int:
    """The position of the first non-blank at or after ``pos``."""
    while pos < len(line) and line[pos] in _BLANKS:
        pos += 1
    return pos


def _parse_labels(line: str, pos: int, lineno: int, labels: list[tuple[str, str]]) -> int:
    """Labels from just after ``{`` to just after ``}``; returns the position after ``}``."""
    seen: set[str] = set()
    while True:
        pos = _skip_blanks(line, pos)
        if line.startswith("}", pos):
            return pos + 1
        match = _LABEL_NAME.match(line, pos)
        if not match:
            raise PageError(f"line {lineno}: invalid label name at column {pos + 1}")
        label = match.group()
        if label == "__name__" or label in seen:
            raise PageError(f"line {lineno}: label {label!r} reserved or repeated")
        seen.add(label)
        pos = _skip_blanks(line, match.end())
        if not line.startswith("=", pos):
            raise PageError(f"line {lineno}: expected '=' after label {label}")
        pos = _skip_blanks(line, pos + 1)
        if not line.startswith('"', pos):
            raise PageError(f"line {lineno}: expected a quoted value for label {label}")
        value = _LABEL_VALUE.match(line, pos + 1)
        if not value:
            raise PageError(f"line {lineno}: unterminated value for label {label}")
        labels.append((label, _unescape(value.group(1), _LABEL_UNESCAPES, lineno, "a label value")))
        pos = _skip_blanks(line, value.end())
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith("}", pos):
            raise PageError(f"line {lineno}: expected ',' or '}}' after label {label}")


@functools.lru_cache(maxsize=4096)  # a page repeats its values (0.0, 1.0, +Inf, le bounds)
def _is_float(token: str) -> bool:
    """A value Go's ParseFloat takes without a range error (promtool rejects 1e400)."""
    return bool(_FLOAT.fullmatch(token)) and ("Inf" in token or not math.isinf(float(token)))


def _check_families(families: list[_Family]) -> None:
    """Cross-line rules: no name taken twice, no duplicate series, well-formed histograms."""
    taken: dict[str, str] = {}
    for family in families:
        for name in family.occupied():
            if taken.setdefault(name, family.name) != family.name:
                raise PageError(
                    f"line {family.line}: {family.name} clashes with {taken[name]} over {name}"
                )
    series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for family in families:
        bound = _SERIES_LABELS.get(family.type or "")
        infinite: dict[tuple[tuple[str, str], ...], bool] = {}
        for sample in family.samples:
            key = tuple(sorted(sample.labels))
            if (sample.name, key) in series:
                raise PageError(f"line {sample.line}: duplicate series {sample.name}{dict(key)}")
            series.add((sample.name, key))
            needs = bound is not None and (
                sample.name.endswith("_bucket") if bound == "le" else sample.name == family.name
            )
            if not needs:
                continue
            values = dict(sample.labels)
            if bound not in values or not _is_float(values[bound]):
                raise PageError(f"line {sample.line}: {sample.name} needs a float {bound!r} label")
            if bound == "le":
                rest = tuple(p for p in key if p[0] != "le")
                infinite[rest] = infinite.get(rest, False) or values["le"] in ("+Inf", "Inf")
        for rest, ok in infinite.items():
            if not ok:
                raise PageError(
                    f"line {family.line}: histogram {family.name}{dict(rest)} has no +Inf bucket"
                )
