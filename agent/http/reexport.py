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

Label rules: ``job`` and ``instance`` belong to Prometheus and the added labels are ours, so an
upstream label with one of those names is kept as ``upstream_<name>`` (more ``upstream_`` prefixes
if that name is taken too). Upstream ``process_*``, ``python_*`` and ``http_*`` families describe
only vLLM's API process and clash with any Python exporter's own, so they are dropped; so is any
family that would collide with a name the agent's own registry serves.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import httpx
import trio
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

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
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_ESCAPE = re.compile(r"\\(.)")
_LABEL_UNESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_HELP_UNESCAPES = {"\\": "\\", "n": "\n"}


class PageError(ValueError):
    """A page that is not valid classic exposition text (the message names the line)."""


class UpstreamError(Exception):
    """The upstream answer is unusable before parsing (status, type, size, time)."""


@dataclass
class _Sample:
    name: str
    labels: list[tuple[str, str]]
    value: str
    timestamp: str | None
    line: int


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
    prefixes = tuple(drop_prefixes)
    reserved = widen_names(reserved_names)
    added = [(name, _escape_label(value)) for name, value in labels.items()]
    taken_by_us = set(PROMETHEUS_LABELS) | set(labels)
    out: list[str] = []
    for family in families:
        if family.name.startswith(prefixes) or family.occupied() & reserved:
            continue
        if family.help is not None:
            out.append(f"# HELP {family.name} {_escape_help(family.help)}\n")
        out.append(f"# TYPE {family.name} {family.type or 'untyped'}\n")
        for sample in family.samples:
            pairs = _rename_ours(sample.labels, taken_by_us)
            text = ",".join(
                [f'{n}="{_escape_label(v)}"' for n, v in pairs] + [f'{n}="{v}"' for n, v in added]
            )
            braces = f"{{{text}}}" if text else ""
            stamp = f" {sample.timestamp}" if sample.timestamp is not None else ""
            out.append(f"{sample.name}{braces} {sample.value}{stamp}\n")
    return "".join(out)


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
    declared: dict[str, _Family] = {}
    raw_samples: list[_Sample] = []
    for lineno, line in enumerate(lines, 1):
        bad = _CONTROL.search(line)
        if bad:
            raise PageError(f"line {lineno}: control character {bad.group()!r}")
        stripped = line.lstrip(_BLANKS)
        if not stripped:
            continue
        if stripped.startswith("#"):
            _parse_comment(stripped, lineno, declared)
        else:
            raw_samples.append(_parse_sample(stripped, lineno))
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


def _parse_labels(line: str, pos: int, lineno: int, labels: list[tuple[str, str]]) -> int:
    """Labels from just after ``{`` to just after ``}``; returns the position after ``}``."""
    seen: set[str] = set()
    while True:
        while pos < len(line) and line[pos] in _BLANKS:
            pos += 1
        if line.startswith("}", pos):
            return pos + 1
        match = _LABEL_NAME.match(line, pos)
        if not match:
            raise PageError(f"line {lineno}: invalid label name at column {pos + 1}")
        label = match.group()
        if label == "__name__" or label in seen:
            raise PageError(f"line {lineno}: label {label!r} reserved or repeated")
        seen.add(label)
        pos = match.end()
        while pos < len(line) and line[pos] in _BLANKS:
            pos += 1
        if not line.startswith("=", pos):
            raise PageError(f"line {lineno}: expected '=' after label {label}")
        pos += 1
        while pos < len(line) and line[pos] in _BLANKS:
            pos += 1
        if not line.startswith('"', pos):
            raise PageError(f"line {lineno}: expected a quoted value for label {label}")
        value = _LABEL_VALUE.match(line, pos + 1)
        if not value:
            raise PageError(f"line {lineno}: unterminated value for label {label}")
        labels.append((label, _unescape(value.group(1), _LABEL_UNESCAPES, lineno, "a label value")))
        pos = value.end()
        while pos < len(line) and line[pos] in _BLANKS:
            pos += 1
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith("}", pos):
            raise PageError(f"line {lineno}: expected ',' or '}}' after label {label}")


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


class UpstreamMetrics:
    """The prefill engine's vLLM /metrics, re-served with role/node/slurm_job_id added."""

    def __init__(
        self,
        url: str,
        labels: Mapping[str, str],
        *,
        timeout_s: float = 2.0,
        max_bytes: int = 16 * 1024 * 1024,
        cache_s: float = 1.0,
        reserved_names: Collection[str] = (),
    ) -> None:
        check_labels(labels)
        self.url = url
        self.labels = dict(labels)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache_s = cache_s
        self.reserved_names = frozenset(reserved_names)
        self.up = False
        self.last_error: str | None = None
        self.last_duration_s: float | None = None
        self.last_bytes = 0
        self._text = ""
        self._fetched_at: float | None = None
        self._lock = trio.Lock()  # one fetch at a time; scrapes that queue behind it reuse it

    async def render(self, client: httpx.AsyncClient, *, budget_s: float | None = None) -> str:
        """The relabelled page (cached for ``cache_s``); "" when the fetch or parse failed.

        ``budget_s`` shortens the fetch timeout for this call (the scraper's own deadline).
        """
        async with self._lock:
            fresh = (
                self._fetched_at is not None and time.monotonic() - self._fetched_at < self.cache_s
            )
            if not fresh:
                self._text = await self._refresh(client, budget_s)
                self._fetched_at = time.monotonic()
            return self._text

    async def _refresh(self, client: httpx.AsyncClient, budget_s: float | None = None) -> str:
        started = time.monotonic()
        self.last_bytes = 0
        timeout_s = self.timeout_s if budget_s is None else min(self.timeout_s, budget_s)
        try:
            with trio.move_on_after(timeout_s) as deadline:
                body = await self._fetch(client)
            if deadline.cancelled_caught:
                raise UpstreamError(f"no complete answer within {timeout_s:g} s")
            try:
                page = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PageError(f"the page is not UTF-8 (byte {exc.start})") from None
            text = await trio.to_thread.run_sync(
                lambda: relabel_page(page, self.labels, reserved_names=self.reserved_names)
            )
        except Exception as exc:  # whatever upstream does, the agent's own page stays up
            if not isinstance(exc, UpstreamError | PageError | httpx.HTTPError | OSError):
                log.exception("re-exporting %s failed unexpectedly", self.url)
            self.up = False
            self.last_error = f"{self.url}: {_describe(exc)}"
            text = ""
        else:
            self.up = True
            self.last_error = None
        self.last_duration_s = time.monotonic() - started
        return text

    async def _fetch(self, client: httpx.AsyncClient) -> bytes:
        """The body, read while streaming and refused as soon as it passes ``max_bytes``."""
        headers = {"Accept": ACCEPT, "Accept-Encoding": "identity"}
        async with client.stream("GET", self.url, headers=headers, timeout=self.timeout_s) as resp:
            if resp.status_code != 200:
                raise UpstreamError(f"HTTP {resp.status_code}")
            ctype = resp.headers.get("content-type", "text/plain")
            if not ctype.lower().startswith("text/plain"):
                raise UpstreamError(f"content-type {ctype!r}, expected text/plain (classic text)")
            encoding = resp.headers.get("content-encoding", "identity").lower()
            if encoding not in ("", "identity"):
                raise UpstreamError(f"content-encoding {encoding!r} although identity was asked")
            length = resp.headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise UpstreamError(f"page of {length} bytes is over the {self.max_bytes} limit")
            chunks = []
            async for chunk in resp.aiter_raw():
                self.last_bytes += len(chunk)
                if self.last_bytes > self.max_bytes:
                    raise UpstreamError(f"page is over the {self.max_bytes}-byte limit")
                chunks.append(chunk)
        return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    """A one-line reason for ``last_error``."""
    if isinstance(exc, UpstreamError | PageError):
        return str(exc)
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})" if str(exc) else "cannot connect"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
