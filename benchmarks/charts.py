"""Benchmark charts, drawn with matplotlib (`rlgraph.runtime.plots`), each written as SVG and PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rlgraph.runtime.plots import new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = ["#9e9e9e", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]


def bar_chart(path: str | Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
              ylabel: str = "step time (s)", note: str = "") -> tuple[Path, Path]:
    """Draw `bar_chart_figure` to ``<path>.svg`` and ``<path>.png``; returns both paths."""
    return save(bar_chart_figure(title, groups, series, ylabel, note), path)


def bar_chart_figure(title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
                     ylabel: str = "step time (s)", note: str = "") -> "Figure":
    """One group of bars per entry of `groups`, one bar per series (same order and colour in every
    group; a NaN value leaves its bar out)."""
    names = list(series)
    width = 0.8 / max(len(names), 1)
    fig = new_figure(max(6.0, 1.1 * len(groups) + 2), 5)
    ax = fig.add_subplot()
    for s, name in enumerate(names):
        xs = [g + (s - (len(names) - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, series[name]) if not math.isnan(v)]
        ax.bar([x for x, _ in kept], [v for _, v in kept], width=width * 0.95, color=COLORS[s % len(COLORS)],
               label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=11)
    if note:
        ax.set_title(note, fontsize=8, color="#555555")
    ax.grid(True, axis="y", color="#e0e0e0")
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, loc="best")
    return fig
