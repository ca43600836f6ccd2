"""Op-call spans and the Chrome/Perfetto ``trace.json`` made of them.

Workers time their own calls (wall clock, `time.time()` so spans of different processes on one
machine line up) and return the span with the call's small result; the driver collects them.
`rlgraph.runtime.plots` draws them as ``timeline.svg``: one lane per worker (group, rank) and one
box per op call, so a user sees which stages overlapped.
"""

from __future__ import annotations

import functools
import json
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

__all__ = ["Compact", "Span", "write_chrome_trace", "PALETTE"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


class Compact:
    """A dataclass pickled without the fields that hold their defaults: what a worker returns for
    each call crosses to the driver, and most calls leave most optional fields empty."""

    def __getstate__(self) -> dict[str, Any]:
        state = {}
        for f, default in _defaults(type(self)):
            value = getattr(self, f.name)
            if default is MISSING or type(value) is not type(default) or value != default:
                state[f.name] = value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for f, _ in _defaults(type(self)):
            if f.name in state:
                value = state[f.name]
            else:  # a fresh default: a mutable one is the object's own
                value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            object.__setattr__(self, f.name, value)  # frozen dataclasses too


@functools.cache
def _defaults(cls: type) -> tuple[tuple[Field, Any], ...]:
    """Each field of dataclass `cls` with its default value (made once, to compare with), or MISSING."""
    return tuple((f, f.default if f.default is not MISSING else
                  f.default_factory() if f.default_factory is not MISSING else MISSING) for f in fields(cls))


@dataclass(frozen=True)
class Span(Compact):
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
    # timed events inside the call (`OpContext.event`): (start, end, lane, label); an agent's turns
    events: tuple[tuple[float, float, int, str], ...] = ()
    io_s: float = 0.0  # of the call's time, reading its inputs from and writing its outputs to the data plane
    fused_into: str = ""  # the op whose call this one ran inside (a fused chain), if any
    read_ahead: int = 0  # input columns the call took from a read ahead of it (`GroupWorker.read_ahead`)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _lane_tid(rank: int, lane: int) -> int:
    """A thread id for lane `lane` of rank `rank`'s calls, apart from the ranks' own ids."""
    return 100_000 * (rank + 1) + lane


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
    lanes: set[tuple[str, int]] = set()
    for s in spans:
        events.append({
            "name": s.op, "cat": f"step{s.step}", "ph": "X", "pid": pid[s.group], "tid": s.rank,
            "ts": round((s.start - t0) * 1e6, 1), "dur": round(s.duration * 1e6, 1),
            "args": {"step": s.step, "chunk": s.chunk, "rows": s.rows,
                     **({"fused_into": s.fused_into} if s.fused_into else {}),
                     **({"read_ahead": s.read_ahead} if s.read_ahead else {})},
        })
        for t, rows in s.parts:  # instant events: when a streaming call handed over each part
            events.append({"name": f"{s.op} part", "cat": f"step{s.step}", "ph": "i", "s": "t", "pid": pid[s.group],
                           "tid": s.rank, "ts": round((t - t0) * 1e6, 1), "args": {"chunk": s.chunk, "rows": rows}})
        for start, end, lane, label in s.events:  # inside the call, one thread per lane (e.g. a trajectory)
            tid = _lane_tid(s.rank, lane)
            if (s.group, tid) not in lanes:
                lanes.add((s.group, tid))
                events.append({"name": "thread_name", "ph": "M", "pid": pid[s.group], "tid": tid,
                               "args": {"name": f"rank {s.rank} {s.op} lane {lane}"}})
            events.append({"name": label, "cat": f"step{s.step}", "ph": "X", "pid": pid[s.group], "tid": tid,
                           "ts": round((start - t0) * 1e6, 1), "dur": round((end - start) * 1e6, 1),
                           "args": {"step": s.step, "lane": lane}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1) + "\n")
    return path

