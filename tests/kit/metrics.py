"""Reading a /metrics page: its samples, its families, one series by name and labels.

Pages are read with prometheus_client's parser, which shares no code with the agent's re-export
(agent/http/reexport.py), so a comparison is an independent check of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]

# vLLM's page as captured (tests/infra/capture_vllm_metrics.py), its OpenMetrics twin and the
# hostile pages (bad-*), shared by the re-export's tests and the upstream fetch's.
PAGES = Path(__file__).resolve().parents[1] / "data" / "metrics"
VLLM_PAGE = PAGES / "vllm-0.32-cpu.txt"
OPENMETRICS_PAGE = PAGES / "vllm-0.32-cpu-openmetrics.txt"
BAD_PAGES = sorted(PAGES.glob("bad-*"))
VLLM_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"  # what vLLM 0.32 answers
# The labels the prefill agent adds in these tests.
PREFILL_LABELS = {"role": "prefill", "node": "gpu-node-01", "slurm_job_id": "4242"}


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
