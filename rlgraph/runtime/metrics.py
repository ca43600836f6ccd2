"""Per-step metrics: accuracy over real rows only, throughput over all rows, driver traffic.

Padding rows never reach accuracy metrics: workers return per-row summaries only for rows
whose ``is_padding`` tag is false. Throughput metrics (samples/s) count every row, padding
included, because padding rows cost compute.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

from rlgraph.runtime.trace import Span

__all__ = ["step_metrics", "flatten_metrics", "MetricsWriter"]


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def flatten_metrics(prefix: str, value: Any) -> dict[str, float]:
    """Numeric leaves of a (nested) metrics dict, keyed ``prefix/a/b``; other leaves dropped."""
    out: dict[str, float] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(flatten_metrics(f"{prefix}/{k}", v))
    elif isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)) and math.isfinite(float(value)):
        out[prefix] = float(value)
    elif hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        out[prefix] = float(value.item())
    return out


def step_metrics(step: int, *, summaries: Mapping[str, list[float]], op_metrics: Mapping[str, list[Any]],
                 spans: Iterable[Span], wall_s: float, real_rows: int, pad_rows: int,
                 driver_payload_bytes: int, driver_result_bytes: int, schedule: str) -> dict[str, Any]:
    """One step's metrics record (one line of metrics.jsonl)."""
    from rlgraph.runtime.worker import SUMMARIES

    m: dict[str, Any] = {"step": step, "schedule": schedule}
    for col, name in SUMMARIES.items():
        m.update(_stats(name, list(summaries.get(col, []))))
    busy: dict[str, float] = defaultdict(float)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    calls: dict[str, int] = defaultdict(int)
    for s in spans:
        busy[s.op] += s.duration
        calls[s.op] += 1
        first[s.op] = min(first.get(s.op, s.start), s.start)
        last[s.op] = max(last.get(s.op, s.end), s.end)
    for op in sorted(busy):
        m[f"timing/{op}/busy_s"] = busy[op]
        m[f"timing/{op}/span_s"] = last[op] - first[op]
        m[f"timing/{op}/calls"] = calls[op]
    for op, records in sorted(op_metrics.items()):
        merged: dict[str, list[float]] = defaultdict(list)
        for rec in records:  # one per rank or per call: average them
            for k, v in flatten_metrics(op, rec).items():
                merged[k].append(v)
        m.update({k: sum(v) / len(v) for k, v in sorted(merged.items())})
    m["timing/step_s"] = wall_s
    m["samples/real"] = real_rows
    m["samples/padding"] = pad_rows
    m["throughput/samples_per_s"] = (real_rows + pad_rows) / wall_s if wall_s > 0 else 0.0
    m["driver/payload_bytes"] = driver_payload_bytes
    m["driver/result_bytes"] = driver_result_bytes
    return m


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl``; on resume keeps steps <= k only."""

    def __init__(self, path: Path, resume_after: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after is None:
            path.write_text("")
        elif path.exists():
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", -1) <= resume_after]
            path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
