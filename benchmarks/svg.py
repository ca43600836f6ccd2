"""A grouped bar chart as a hand-written SVG (no plotting dependency)."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Sequence

COLORS = ["#9e9e9e", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]


def bar_chart(path: Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
              ylabel: str = "step time (s)", note: str = "") -> Path:
    """One group of bars per entry of `groups`, one bar per series (same order in every group)."""
    names = list(series)
    n_g, n_s = len(groups), len(names)
    top = max([v for vs in series.values() for v in vs if v == v] + [1e-9])
    # a "nice" axis maximum
    mag = 10 ** len(str(int(top))) / 10 if top >= 1 else 0.1
    ymax = next(m * mag for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 15, 20) if m * mag >= top)
    left, right, ptop, bottom = 60, 20, 50, 150
    gw = max(60, 18 * n_s + 24)
    width = left + right + gw * n_g
    height = 430
    ph = height - ptop - bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>']
    if note:
        out.append(f'<text x="{width / 2}" y="34" text-anchor="middle" fill="#555">{escape(note)}</text>')
    for k in range(6):
        v = ymax * k / 5
        y = ptop + ph - ph * v / ymax
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    out.append(f'<text x="14" y="{ptop + ph / 2}" transform="rotate(-90 14 {ptop + ph / 2})" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    bw = (gw - 24) / n_s
    for g, label in enumerate(groups):
        x0 = left + g * gw + 12
        for s, name in enumerate(names):
            v = series[name][g]
            if v != v:
                continue
            h = ph * v / ymax
            out.append(f'<rect x="{x0 + s * bw:.1f}" y="{ptop + ph - h:.1f}" width="{bw - 1:.1f}" height="{h:.1f}" '
                       f'fill="{COLORS[s % len(COLORS)]}"><title>{escape(label)} {escape(name)}: {v:.3g}</title></rect>')
        cx = x0 + (gw - 24) / 2
        out.append(f'<text x="{cx:.1f}" y="{ptop + ph + 12}" text-anchor="end" '
                   f'transform="rotate(-40 {cx:.1f} {ptop + ph + 12})">{escape(label)}</text>')
    for s, name in enumerate(names):
        x = left + s * 110
        out.append(f'<rect x="{x}" y="{height - 18}" width="12" height="12" fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{x + 16}" y="{height - 8}">{escape(name)}</text>')
    out.append("</svg>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    return path
