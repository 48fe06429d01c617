"""The PNG charts of a benchmark: the ones people compare recipes with.

- ``output_throughput``: output tokens/s (all users) vs concurrency;
- ``latency``: TTFT and ITL p50/p90/p99 vs concurrency, side by side;
- ``pareto``: output tokens/s per GPU vs tokens/s per user (interactivity), one point per level,
  the InferenceX chart: up is cheaper, right is snappier. A job without GPUs (the stand-ins)
  plots tokens/s for the whole job instead, and says so on the axis.

Each chart has one curve per series (one run, or one job of ``tilert-submit bench --compare``).
matplotlib is the optional ``plots`` extra (``pip install 'tilert-agent[plots]'``): without it no
chart is made and ``PlotsUnavailable`` says how to get them; the agent's own install stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import RuntimeFailure
from agent.job.benchmark import LevelResult

PLOT_NAMES = ("output_throughput", "latency", "pareto")
INSTALL_HINT = "install the plots extra (pip install 'tilert-agent[plots]') for PNG charts"


class PlotsUnavailable(RuntimeFailure):
    """matplotlib cannot be imported here; ``str()`` says how to get the charts."""


@dataclass(frozen=True)
class Series:
    """One curve: a label and its levels (those with measurements)."""

    label: str
    levels: Sequence[LevelResult]

    def measured(self) -> list[LevelResult]:
        """Levels with a throughput, by concurrency."""
        return sorted(
            (lv for lv in self.levels if lv.output_throughput is not None),
            key=lambda lv: lv.concurrency,
        )


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a compute node
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable(f"matplotlib is not installed: {INSTALL_HINT}") from None
    return plt


def make_plots(series: Sequence[Series], out_dir: Path, title: str) -> list[Path]:
    """Write the charts of ``series`` into ``out_dir``; the PNG files written."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = [s for s in series if s.measured()]
    written = []
    legend = len(drawn) > 1

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in drawn:
        pts = s.measured()
        ax.plot(
            [p.concurrency for p in pts], [p.output_throughput for p in pts], "o-", label=s.label
        )
    _levels_axis(ax, drawn)
    _axes(ax, "concurrency", "output tokens/s", f"{title}: output throughput", legend)
    written.append(_save(fig, plt, out_dir / "output_throughput.png"))

    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, name, what in ((ttft, "ttft", "TTFT"), (itl, "itl", "ITL")):
        for s in drawn:
            pts = s.measured()
            xs = [p.concurrency for p in pts]
            for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                ys = [getattr(p, f"{name}_{pct}_ms") for p in pts]
                if any(y is not None for y in ys):
                    label = f"{s.label} {pct}" if legend else pct
                    ax.plot(
                        xs, [y if y is not None else float("nan") for y in ys], style, label=label
                    )
        _levels_axis(ax, drawn)
        _axes(ax, "concurrency", f"{what} (ms)", f"{what} percentiles", True)
    fig.suptitle(title)
    written.append(_save(fig, plt, out_dir / "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    per_gpu = all(p.output_throughput_per_gpu is not None for s in drawn for p in s.measured())
    for s in drawn:
        pts = [p for p in s.measured() if p.output_throughput_per_user is not None]
        ys = [p.output_throughput_per_gpu if per_gpu else p.output_throughput for p in pts]
        ax.plot([p.output_throughput_per_user for p in pts], ys, "o-", label=s.label)
        for p, y in zip(pts, ys, strict=True):
            ax.annotate(f"c{p.concurrency}", (p.output_throughput_per_user, y), fontsize=7)
    ylabel = "output tokens/s per GPU" if per_gpu else "output tokens/s (job has no GPU)"
    _axes(ax, "output tokens/s per user", ylabel, f"{title}: throughput vs interactivity", legend)
    written.append(_save(fig, plt, out_dir / "pareto.png"))
    return written


def _levels_axis(ax: Any, series: Sequence[Series]) -> None:
    """Concurrency on a log2 axis ticked at the levels measured (1, 4, 16, ... read evenly)."""
    levels = sorted({p.concurrency for s in series for p in s.measured()})
    if len(levels) > 1 and levels[0] > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()


def _axes(ax: Any, xlabel: str, ylabel: str, title: str, legend: bool) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
