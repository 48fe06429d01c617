"""Reading a /metrics page: its samples, its families, one series by name and labels.

Pages are read with prometheus_client's parser, which shares no code with the agent's re-export
(agent/http/reexport.py), so a comparison is an independent check of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


# ---- pages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One sample line: name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def samples(page: str) -> list[Sample]:
    """Every sample of a classic text page (prometheus_client's parser, independent of ours)."""
    out = []
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out.append(Sample(s.name, dict(s.labels), float(s.value)))
    return out


def sample_map(page: str) -> dict[tuple[str, Labels], float]:
    """``{(name, labels): value}`` of a page; a duplicate series fails."""
    out: dict[tuple[str, Labels], float] = {}
    for s in samples(page):
        key = (s.name, frozenset(s.labels.items()))
        assert key not in out, f"series twice on the page: {s.name}{s.labels}"
        out[key] = s.value
    return out


def families(page: str) -> list[str]:
    """Family names in TYPE order, after checking that no family or sample name repeats."""
    declared: list[str] = []
    owner: dict[str, str] = {}
    current = ""
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            current = line.split()[2]
            assert current not in declared, f"family {current} declared twice on the page"
            declared.append(current)
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            assert owner.setdefault(name, current) == current, (
                f"{name} appears under both {owner[name]} and {current}"
            )
    return declared


def find(page_samples: Iterable[Sample], name: str, **labels: str) -> Iterator[Sample]:
    """Samples called ``name`` whose labels include ``labels``."""
    for s in page_samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            yield s


def one(page_samples: Iterable[Sample], name: str, **labels: str) -> Sample:
    """The single sample ``name{labels...}``; fails naming what was found."""
    found = list(find(page_samples, name, **labels))
    assert len(found) == 1, f"expected one {name}{labels}, found {found}"
    return found[0]
