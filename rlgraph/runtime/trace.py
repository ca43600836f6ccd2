"""Op-call spans: a Chrome/Perfetto ``trace.json`` and a ``timeline.svg`` of ops against time.

Workers time their own calls (wall clock, `time.time()` so spans of different processes on one
machine line up) and return the span with the call's small result; the driver collects them.
The timeline has one lane per worker (group, rank) and one box per op call, so a user sees
which stages overlapped.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["Span", "write_chrome_trace", "write_timeline_svg", "PALETTE"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


@dataclass(frozen=True)
class Span:
    """One op call on one worker."""

    op: str
    group: str
    rank: int
    step: int
    chunk: int
    rows: int
    start: float  # seconds since the epoch
    end: float
    parts: tuple[tuple[float, int], ...] = ()  # a streaming call: (time, rows) of each part handed over
    local_bytes: int = 0  # column bytes the call moved to or from storage on its own node
    cross_node_bytes: int = 0  # ... on another node (known for TransferQueue)

    @property
    def duration(self) -> float:
        return self.end - self.start


def write_chrome_trace(spans: Iterable[Span], path: str | Path) -> Path:
    """Write spans in the Chrome trace-event format (open in Perfetto or chrome://tracing)."""
    spans = sorted(spans, key=lambda s: (s.start, s.group, s.rank))
    t0 = spans[0].start if spans else 0.0
    groups = sorted({s.group for s in spans})
    pid = {g: i + 1 for i, g in enumerate(groups)}
    events: list[dict] = []
    for g in groups:
        events.append({"name": "process_name", "ph": "M", "pid": pid[g], "args": {"name": f"group {g}"}})
    for g, r in sorted({(s.group, s.rank) for s in spans}):
        events.append({"name": "thread_name", "ph": "M", "pid": pid[g], "tid": r, "args": {"name": f"rank {r}"}})
    for s in spans:
        events.append({
            "name": s.op, "cat": f"step{s.step}", "ph": "X", "pid": pid[s.group], "tid": s.rank,
            "ts": round((s.start - t0) * 1e6, 1), "dur": round(s.duration * 1e6, 1),
            "args": {"step": s.step, "chunk": s.chunk, "rows": s.rows},
        })
        for t, rows in s.parts:  # instant events: when a streaming call handed over each part
            events.append({"name": f"{s.op} part", "cat": f"step{s.step}", "ph": "i", "s": "t", "pid": pid[s.group],
                           "tid": s.rank, "ts": round((t - t0) * 1e6, 1), "args": {"chunk": s.chunk, "rows": rows}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1) + "\n")
    return path


def write_timeline_svg(spans: Iterable[Span], path: str | Path, title: str = "timeline") -> Path:
    """Draw one lane per worker and one box per op call, coloured by op and numbered by step
    (where it is wide enough), against time."""
    spans = sorted(spans, key=lambda s: (s.start, s.group, s.rank))
    lanes = sorted({(s.group, s.rank) for s in spans})
    ops = sorted({s.op for s in spans})
    colour = {o: PALETTE[i % len(PALETTE)] for i, o in enumerate(ops)}
    t0 = min((s.start for s in spans), default=0.0)
    t1 = max((s.end for s in spans), default=1.0)
    total = max(t1 - t0, 1e-6)
    left, width, lane_h, top = 140, 900, 22, 40
    height = top + lane_h * len(lanes) + 60 + 18 * ((len(ops) + 3) // 4)
    x = lambda t: left + (t - t0) / total * width  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="20" font-size="14">{html.escape(title)} ({total:.2f} s)</text>',
    ]
    for i, (g, r) in enumerate(lanes):
        y = top + i * lane_h
        out.append(f'<text x="5" y="{y + 15}">{html.escape(g)}[{r}]</text>')
        out.append(f'<line x1="{left}" y1="{y + lane_h}" x2="{left + width}" y2="{y + lane_h}" stroke="#ddd"/>')
    for s in spans:
        y = top + lanes.index((s.group, s.rank)) * lane_h + 2
        w = max(x(s.end) - x(s.start), 0.5)
        tip = f"{s.op} step {s.step} chunk {s.chunk}: {s.rows} rows, {s.duration * 1e3:.1f} ms"
        out.append(f'<rect x="{x(s.start):.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 4}" '
                   f'fill="{colour[s.op]}" stroke="#333" stroke-width="0.3"><title>{html.escape(tip)}</title></rect>')
        if w >= 12:  # the step number, so that steps in flight together (max_staleness > 0) read apart
            out.append(f'<text x="{x(s.start) + 2:.2f}" y="{y + lane_h - 8}" font-size="8" fill="#222">{s.step}</text>')
        for t, rows in s.parts:  # a tick where a streaming call handed over a part
            out.append(f'<line x1="{x(t):.2f}" y1="{y}" x2="{x(t):.2f}" y2="{y + lane_h - 4}" stroke="#000" '
                       f'stroke-width="1"><title>{html.escape(f"{s.op}: {rows} rows handed over")}</title></line>')
    axis_y = top + lane_h * len(lanes) + 15
    for k in range(6):
        t = total * k / 5
        out.append(f'<text x="{x(t0 + t) - 10:.1f}" y="{axis_y}">{t:.2f}s</text>')
    for i, o in enumerate(ops):
        lx, ly = left + (i % 4) * 220, axis_y + 20 + (i // 4) * 18
        out.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{colour[o]}"/>')
        out.append(f'<text x="{lx + 16}" y="{ly}">{html.escape(o)}</text>')
    out.append("</svg>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    return path
