"""A step's admission: its partition created, the source's call filling it, then its scheduler in
the window (`rlgraph.runtime.runner.Runner.admit`).

The event loop admits a training step in two halves so that it does not wait for the source:
`begin` creates the partition and starts the source's call; the loop goes on handing out and
taking in the calls of the steps in flight, and `admitted` makes the step live once the source's
result (the rows' group ids and padding tags) is in. One admission is in flight at a time, so
steps enter the window in order. On a small step the source's call is 2.4 ms the driver no longer
waits; on 4,096 rows, 16 ms (docs/performance.md, section 12).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlgraph.runtime.scheduler import StepScheduler
from rlgraph.runtime.step import VALIDATE, LiveStep, StepKey

if TYPE_CHECKING:
    from rlgraph.runtime.runner import Runner

__all__ = ["Admission", "admitted", "begin", "pending"]


@dataclass
class Admission:
    """A step being admitted: its partition created, the source's call filling it still running."""

    key: StepKey
    partition: str
    ops: set[str] | None
    reads: int | None
    row_nodes: list[str] | None
    t0: float
    bytes0: int
    ref: Any  # the source's call


def pending(inflight: dict[Any, Any]) -> list[Admission]:
    """The admissions in the event loop's `inflight` (waitable -> ("admit", Admission), or a call's or
    a sync's entry)."""
    return [w[1] for w in inflight.values() if w[0] == "admit"]


def begin(runner: Runner, key: StepKey, partition: str | None = None, ops: set[str] | None = None,
          uid_start: int | None = None, reads: int | None = None) -> Admission | LiveStep:
    """Create the partition of the step at `key` and start the source's call to fill it (a step
    whose batch dynamic sampling refills comes back admitted: its rounds ran)."""
    from rlgraph.runtime.dataplane import payload_bytes_in_this_process

    step = key.step
    # a retried step gets a fresh partition: calls abandoned by the failed attempt may still write
    retry = runner.recovery.attempts.get(step)
    partition = partition or f"train_{step}" + (f"_retry{retry}" if retry else "")
    if key.training and ops is None and runner.refiller is not None:
        return runner.refiller.admit(step, partition)
    b = runner.plan.batch
    rows = b.padded_batch_warmup if step < b.critic_warmup else b.padded_batch
    t0, bytes0 = time.time(), payload_bytes_in_this_process()
    homes, row_nodes = runner.fleet.homes(rows)
    # every client is handed the rows' addresses (calls, reads ahead, the source's produce), but the
    # source's assembly of a refilled batch looks the rounds' rows up by name
    runner.fleet.plane.create_partition(partition, rows, homes, lookup=runner.refiller is not None)
    try:
        ref = runner.fleet.produce(partition, rows, step * rows if uid_start is None else uid_start,
                                   key.phase == VALIDATE)
    except BaseException:
        runner.fleet.clear(partition)
        raise
    return Admission(key, partition, ops, reads, row_nodes, t0, bytes0, ref)


def admitted(runner: Runner, a: Admission) -> LiveStep:
    """The source's call of `a` is done (or failed: its partition is cleared and the error raised):
    the step, its scheduler in the window."""
    key = a.key
    try:
        uids, is_padding, data = runner.fleet.result(a.ref, f"the data source to write partition {a.partition!r}")
    except BaseException:
        runner.fleet.clear(a.partition)
        raise
    sched = StepScheduler(runner.plan, uids, is_padding, key.step, runner.schedule, a.ops, slots=runner.slots,
                          gated=runner.window.gated_ops(reads_fixed=not key.training), row_nodes=a.row_nodes,
                          rank_nodes=runner.fleet.node_of)
    runner.window.admit(key, sched, reads=key.step if a.reads is None and not key.training else a.reads)
    runner.fleet.read_ahead(a.partition, sched, a.ops)  # e.g. generation's prompts, read while the update runs
    if key.training:
        runner.reporter.step_started(key.step, sched.chunk_counts())
    return LiveStep(key, a.partition, sched, list(is_padding), a.t0, a.bytes0, source_metrics=data)
