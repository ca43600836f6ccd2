"""Per-step metrics: the one builder of a step's record, and the one writer and reader of
metrics.jsonl.

Accuracy metrics cover real rows only: workers return per-row summaries only for rows whose
``is_padding`` tag is false. Throughput metrics (samples/s) count every row, padding included,
because padding rows cost compute. A record's ``step`` is the training step's integer number.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from rlgraph.runtime.trace import Span
from rlgraph.runtime.rundir import fsync, write_atomic

if TYPE_CHECKING:
    from rlgraph.graph.plan import Plan
    from rlgraph.runtime.step import LiveStep

__all__ = ["step_record", "IdleClock", "flatten_metrics", "MetricsWriter", "read_metrics"]


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


def _step_metrics(step: int, *, summaries: Mapping[str, list[float]], names: Mapping[str, str],
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
    io: dict[str, float] = defaultdict(float)
    for s in spans:
        busy[s.op] += s.duration
        io[s.op] += s.io_s
        calls[s.op] += 1
        load[(s.op, s.rank)][0] += 1
        load[(s.op, s.rank)][1] += s.rows
        first[s.op] = min(first.get(s.op, s.start), s.start)
        last[s.op] = max(last.get(s.op, s.end), s.end)
    for op in sorted(busy):
        m[f"timing/{op}/busy_s"] = busy[op]
        m[f"timing/{op}/span_s"] = last[op] - first[op]
        m[f"timing/{op}/io_s"] = io[op]
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


class IdleClock:
    """How long each worker group sat idle before a training step's first call on it (waiting for
    its inputs, for weights or for the previous step): the rollout's idle time is what running
    ahead removes. Forgets everything after a restore."""

    def __init__(self) -> None:
        self._last_end: dict[str, float] = {}  # group -> end of its latest call in the steps done

    def record(self, spans: list[Span]) -> dict[str, float]:
        out = {}
        for group in sorted({s.group for s in spans}):
            mine = [s for s in spans if s.group == group]
            if group in self._last_end:
                out[f"timing/idle/{group}_s"] = max(0.0, min(s.start for s in mine) - self._last_end[group])
            self._last_end[group] = max([self._last_end.get(group, 0.0), *(s.end for s in mine)])
        return out

    def clear(self) -> None:
        self._last_end.clear()


def step_record(lv: LiveStep, plan: Plan, schedule: str, idle: IdleClock | None = None, *,
                retries: int | None = None, restarts: int = 0, validation: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The metrics record of finished step `lv`: one line of metrics.jsonl, or (validation) the
    source of its ``val/`` keys. `idle` tracks the groups' idle time across training steps;
    `retries` and `validation` are added to a training step's record."""
    sched, rec = lv.sched, lv.rec
    real = sum(1 for p in lv.is_padding if not p)
    pad = len(lv.is_padding) - real
    summaries = {c: [v for r, v in sorted(vals.items()) if r not in sched.dropped]
                 for c, vals in rec.summaries.items()}
    reasons: dict[str, int] = dict(lv.refill.get("dropped", {}))  # a refilled step: the rounds' drops
    if lv.refill:  # every round's real samples: the trained ones, and those dropped or left over
        real = lv.refill["real"]
    for reason, _ in sched.dropped.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    m = _step_metrics(lv.step, summaries=summaries, names=plan.summaries, op_metrics=rec.op_metrics,
                      spans=rec.spans, wall_s=lv.t1 - lv.t0, real_rows=real, pad_rows=pad,
                      dropped=reasons, driver_payload_bytes=lv.bytes1 - lv.bytes0,
                      driver_result_bytes=rec.result_bytes, schedule=schedule)
    m["faults/restarts"] = rec.restarts + restarts  # restarted in this step's calls, and by a restore before it
    m.update({f"data/{k}": v for k, v in lv.source_metrics.items()})
    m.update(lv.refill.get("metrics", {}))
    local, remote = sum(s.local_bytes for s in rec.spans), sum(s.cross_node_bytes for s in rec.spans)
    if local or remote:  # the plane knows where each row is stored (TransferQueue)
        m["dataplane/local_bytes"] = local
        m["dataplane/cross_node_bytes"] = remote
        m["dataplane/cross_node_frac"] = remote / (local + remote)
    m["timing/state_sync_s"] = rec.sync_s
    m["timing/step_end"] = lv.t1  # the driver's clock (Unix time): gaps between step ends, to the microsecond
    if lv.training and idle is not None:
        m.update(idle.record(rec.spans))
    if retries is not None:
        m["faults/retries"] = retries
    if validation:
        names = set(plan.summaries.values())
        m.update({f"val/{k}": v for k, v in validation.items() if k.split("/")[0] in names})
    return m


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl``, each line flushed (a killed run loses no
    line it wrote) and made durable by `sync`, which the runner calls before each checkpoint and at
    the run's end: the lines a resume keeps (steps up to its checkpoint) are on disk before that
    checkpoint is, without an fsync on every step's path (0.5-0.7 ms of the driver's time a step
    here). On resume keeps the steps <= k only (a line cut short by a kill or a full disk is
    dropped, with a warning)."""

    def __init__(self, path: Path, resume_after: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = [] if resume_after is None else [r for r in read_metrics(path, warn=True)
                                                if r.get("step", -1) <= resume_after]
        write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def sync(self) -> None:
        """Make every line written so far durable."""
        fsync(self.path)


def read_metrics(path: Path, warn: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if there is no file). A line that is not a whole JSON
    object (the last one, cut short by a kill or a full disk) is skipped, with a warning if `warn`."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if warn:
                warnings.warn(f"{path}:{n} is not a whole metrics record (cut short by a kill or a full disk?); "
                              f"dropped it", RuntimeWarning, stacklevel=2)
            continue
        out.append(record)
    return out
