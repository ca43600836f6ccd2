"""A step in flight: its key in the window, its partition, its scheduler and what its calls returned.

Several kinds of step share the event loop, and their keys order them: the refill rounds of
training step t (dynamic sampling) run before it, its validation after it, and all of them before
step t+1. Keys are `StepKey` tuples of integers, so nothing is ordered by a float.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlgraph.runtime.scheduler import Call, StepScheduler
from rlgraph.runtime.trace import Span

__all__ = ["StepKey", "StepRecord", "LiveStep", "ROUND", "TRAIN", "VALIDATE", "describe_inflight"]

ROUND, TRAIN, VALIDATE = 0, 1, 2  # the phases of one step, in the order they run


class StepKey(NamedTuple):
    """Where a step sits in the window: training step `step`, one of its refill rounds, or the
    validation after it."""

    step: int
    phase: int = TRAIN
    round: int = 0

    @property
    def training(self) -> bool:
        return self.phase == TRAIN

    def __str__(self) -> str:
        return (f"{self.step}" if self.phase == TRAIN else f"{self.step}.val" if self.phase == VALIDATE
                else f"{self.step}.round{self.round}")


@dataclass
class StepRecord:
    """What one step's calls returned: the raw material of its metrics record (`rlgraph.runtime.metrics`)."""

    spans: list[Span] = field(default_factory=list)
    summaries: dict[str, dict[Any, float]] = field(default_factory=dict)  # column -> row -> value
    op_metrics: dict[str, list[Any]] = field(default_factory=dict)
    batch_values: dict[str, Any] = field(default_factory=dict)  # batch-level data columns, for later calls
    result_bytes: int = 0
    restarts: int = 0  # worker actors restarted
    sync_s: float = 0.0  # waiting for state columns (weights) to reach the groups that read them

    def take_summaries(self, summaries: dict[str, dict[int, float]]) -> None:
        for col, vals in summaries.items():
            self.summaries.setdefault(col, {}).update(vals)

    def absorb(self, other: StepRecord, tag: Any) -> None:
        """Add a refill round's record to its step's; the round's summary rows are keyed
        ``(tag, row)`` until the step knows which of them it trains on."""
        self.spans += other.spans
        self.result_bytes += other.result_bytes
        self.restarts += other.restarts
        self.sync_s += other.sync_s
        self.batch_values.update(other.batch_values)
        for op, records in other.op_metrics.items():
            self.op_metrics.setdefault(op, []).extend(records)
        for col, vals in other.summaries.items():
            self.summaries.setdefault(col, {}).update({(tag, r): v for r, v in vals.items()})


@dataclass
class LiveStep:
    """A step in flight: its partition, scheduler and record."""

    key: StepKey
    partition: str
    sched: StepScheduler
    is_padding: list[bool]
    t0: float
    bytes0: int  # payload bytes through the driver when it was admitted
    t1: float = 0.0  # when it finished
    bytes1: int = 0  # ... and those bytes then
    rec: StepRecord = field(default_factory=StepRecord)
    salt: int = 0  # a refill round: enters its calls' seeds
    keep: bool = False  # keep the partition once done (a refill round: its kept rows are copied later)
    quiet: frozenset[str] = frozenset()  # ops whose op metrics are not recorded (the rounds' ops on padding)
    refill: dict[str, Any] = field(default_factory=dict)  # the rounds' accounting: real, dropped, metrics
    source_metrics: dict[str, float] = field(default_factory=dict)  # the data source's, of this batch (data/...)

    @property
    def step(self) -> int:
        return self.key.step

    @property
    def training(self) -> bool:
        return self.key.training

    def take_part(self, call: Call, part: Any) -> None:
        """A streaming call's part (`rlgraph.runtime.worker.PartResult`): its rows are ready now."""
        self.rec.result_bytes += len(pickle.dumps(part))
        self.rec.take_summaries(part.summaries)
        self.sched.rows_done(call.chunk.op, part.rows)

    def take(self, call: Call, result: Any) -> bool:
        """A call's small result (`rlgraph.runtime.worker.CallResult`): span, per-row summaries,
        drops, op metrics, batch values, and those of the ops fused into the call. True when it
        was the last call of its chunk."""
        rec = self.rec
        rec.result_bytes += len(pickle.dumps(result))  # the driver's traffic, a metric
        for op, r in [(call.chunk.op, result), *zip((name for name, _ in call.fused), result.fused, strict=True)]:
            rec.spans.append(r.span)
            rec.take_summaries(r.summaries)
            for row, (reason, whole_group) in r.dropped.items():
                self.sched.drop(row, reason, op, whole_group)
            if op not in self.quiet:
                rec.op_metrics.setdefault(op, []).extend(m for m in r.metrics if m)
            rec.batch_values.update(r.batch_values)
        return self.sched.call_done(call)


def describe_inflight(inflight: dict[Any, Any]) -> list[str]:
    """What the event loop waits for, for people: each call in flight, each weight sync."""
    return sorted({f"weight sync of {k[1]!r} to {k[2]!r}" if k[0] == "sync" else
                   f"the data source filling {k[1].partition!r}" if k[0] == "admit" else
                   f"step {k[0]}: {k[1].chunk.op}{[c.index for c in k[1].chunks]} on {k[1].group}[{k[1].rank}]"
                   for k in inflight.values()})
