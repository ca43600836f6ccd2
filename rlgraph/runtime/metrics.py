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


def _merge(key: str, values: list[float]) -> float:
    """One op metric over the step's calls (one record per call or per rank): counts (names ending in
    ``_count``) add up, maxima (``_max``) and minima (``_min``) stay extreme, anything else is averaged.
    Durations and rates (``_s``) are reported as ``timing/<op>/<key>``."""
    if key.endswith("_count"):
        return sum(values)
    if key.endswith("_max"):
        return max(values)
    if key.endswith("_min"):
        return min(values)
    return sum(values) / len(values)


def step_metrics(step: int, *, summaries: Mapping[str, list[float]], names: Mapping[str, str],
                 op_metrics: Mapping[str, list[Any]],
                 spans: Iterable[Span], wall_s: float, real_rows: int, pad_rows: int,
                 driver_payload_bytes: int, driver_result_bytes: int, schedule: str,
                 dropped: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One step's metrics record (one line of metrics.jsonl).

    Sample accounting: ``samples/real`` (produced by the source) = ``samples/trained`` +
    ``samples/dropped``; ``samples/padding`` counts the rows added to fill the padded batch;
    ``samples/dropped/<reason>`` splits the drops by reason. `names` maps each summarised column
    to its metric name (the pipeline's ``summaries``): ``<name>/mean``, ``/max``, ``/min``."""
    m: dict[str, Any] = {"step": step, "schedule": schedule}
    for col, name in names.items():
        m.update(_stats(name, list(summaries.get(col, []))))
    busy: dict[str, float] = defaultdict(float)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    calls: dict[str, int] = defaultdict(int)
    load: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])  # (op, rank) -> [calls, rows]
    for s in spans:
        busy[s.op] += s.duration
        calls[s.op] += 1
        load[(s.op, s.rank)][0] += 1
        load[(s.op, s.rank)][1] += s.rows
        first[s.op] = min(first.get(s.op, s.start), s.start)
        last[s.op] = max(last.get(s.op, s.end), s.end)
    for op in sorted(busy):
        m[f"timing/{op}/busy_s"] = busy[op]
        m[f"timing/{op}/span_s"] = last[op] - first[op]
        m[f"timing/{op}/calls"] = calls[op]
    for (op, rank), (n_calls, n_rows) in sorted(load.items()):
        m[f"load/{op}/rank_{rank}/calls"] = n_calls
        m[f"load/{op}/rank_{rank}/rows"] = n_rows
    for op, records in sorted(op_metrics.items()):
        merged: dict[str, list[float]] = defaultdict(list)
        for rec in records:  # one per rank or per call: average them
            for k, v in flatten_metrics(op, rec).items():
                merged[k].append(v)
        for k, v in sorted(merged.items()):
            # a duration or a rate (a key ending in _s: seconds, tokens_per_s) differs from run to run:
            # it goes under timing/<op>/, with the step's other timings, not among the op's results
            name = f"timing/{op}/{k.rsplit('/', 1)[1]}" if k.endswith("_s") else k
            m[name] = _merge(k, v)
    m["timing/step_s"] = wall_s
    n_dropped = sum((dropped or {}).values())
    m["samples/real"] = real_rows
    m["samples/trained"] = real_rows - n_dropped
    m["samples/dropped"] = n_dropped
    for reason, count in sorted((dropped or {}).items()):
        m[f"samples/dropped/{reason}"] = count
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
        if resume_after is None or not path.exists():
            path.write_text("")
        else:
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", -1) <= resume_after]
            path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

