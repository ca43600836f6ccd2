"""Dynamic sampling (DAPO): generation rounds until the groups a filter keeps fill the batch.

The compiler records in `Plan.refill` the *round ops* (the filter declared ``refill=True`` and
everything upstream of it), the columns the kept rows carry past it, ``max_rounds`` and
``on_exhaust``. A training step with a refill then runs in two phases:

1. rounds: each a partition of its own, filled by the source with fresh prompts and run by an
   ordinary `StepScheduler` restricted to the round ops, with the weights the step itself reads
   and its calls salted into their own seeds, until the kept groups fill ``data.batch_size``
   prompts or the rounds run out (``on_exhaust``: train on what was kept, or `RefillExhausted`);
2. the step: the source actor copies the first ``data.batch_size`` kept groups' carried columns
   into the step's partition and writes padding rows up to the plan's multiple; the step's
   scheduler is told those columns are present on the copied rows and runs the round ops on the
   padding rows only, and every later op on all rows.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Protocol

from rlgraph.errors import RefillExhausted
from rlgraph.graph.plan import Plan
from rlgraph.runtime.fleet import Fleet
from rlgraph.runtime.recovery import plane_lost
from rlgraph.runtime.scheduler import Slots, StepScheduler
from rlgraph.runtime.step import ROUND, LiveStep, StepKey, StepRecord
from rlgraph.runtime.window import Window

__all__ = ["Refiller"]


class StepRunner(Protocol):
    """What the rounds need of the runner (`rlgraph.runtime.runner.Runner` is one)."""

    plan: Plan
    fleet: Fleet
    window: Window
    slots: Slots
    schedule: str
    reporter: Any

    def admit(self, key: StepKey, partition: str | None = None, ops: set[str] | None = None,
              uid_start: int | None = None, reads: int | None = None) -> LiveStep: ...

    def run_alone(self, lv: LiveStep) -> None: ...


class Refiller:
    """Fills a training step's batch by rounds of the ops up to the filter."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.plan = runner.plan
        self._said_exhausted = False

    def admit(self, step: int, partition: str) -> LiveStep:
        """Run step `step`'s rounds, then admit the step itself on the kept groups (see the module)."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        runner, rf, b = self.runner, self.plan.refill, self.plan.batch
        fleet = runner.fleet
        warm = step < b.critic_warmup
        rows = b.padded_batch_warmup if warm else b.padded_batch
        multiple = b.multiple_warmup if warm else b.multiple
        span = rf.max_rounds + 2  # uid blocks of `rows` per step: one per round, one for the padding
        t0, bytes0 = time.time(), payload_bytes_in_this_process()
        rec = StepRecord()
        kept: list[tuple[str, list[int], list[int]]] = []  # (round partition, rows, uids) of each kept group
        reasons: dict[str, int] = {}
        real = rounds = generated = 0
        made: list[str] = []
        try:
            for k in range(rf.max_rounds):
                if len(kept) >= b.batch_size:
                    break
                part = f"{partition}_round{k}"
                lv = runner.admit(StepKey(step, ROUND, k), partition=part, ops=set(rf.round_ops),
                                  uid_start=(step * span + k) * rows, reads=step - 1)
                lv.salt, lv.keep = k, True
                made.append(part)
                runner.run_alone(lv)
                rounds += 1
                sched = lv.sched
                groups: dict[int, list[int]] = {}
                for r in range(sched.num_rows):
                    if not sched.is_padding[r]:
                        real += 1
                        if r not in sched.dropped:
                            groups.setdefault(sched.uids[r], []).append(r)
                generated += len({sched.uids[r] for r in range(sched.num_rows) if not sched.is_padding[r]})
                for reason, _ in sched.dropped.values():
                    reasons[reason] = reasons.get(reason, 0) + 1
                kept += [(part, rs, [sched.uids[r] for r in rs]) for rs in groups.values()]
                rec.absorb(lv.rec, part)  # summaries re-keyed below, to the rows of the batch
            exhausted = len(kept) < b.batch_size
            if exhausted:
                self._exhausted(step, rounds, len(kept), generated, reasons)
            surplus = kept[b.batch_size:]
            kept = kept[:b.batch_size]
            if surplus:
                reasons["surplus"] = sum(len(rs) for _, rs, _ in surplus)
            n_kept = sum(len(rs) for _, rs, _ in kept)
            padded = max(multiple, -(-n_kept // multiple) * multiple)
            pad_start = (step * span + rf.max_rounds + 1) * rows
            uids = [u for _, _, us in kept for u in us] + [pad_start + i for i in range(padded - n_kept)]
            is_padding = [False] * n_kept + [True] * (padded - n_kept)
            picks: list[tuple[str, list[int]]] = []
            for part, rs, _ in kept:
                if picks and picks[-1][0] == part:
                    picks[-1][1].extend(rs)
                else:
                    picks.append((part, list(rs)))
            homes, row_nodes = fleet.homes(padded)
            fleet.plane.create_partition(partition, padded, homes)
            try:
                fleet.assemble(partition, picks, list(rf.carried), padded - n_kept, pad_start)
            except BaseException:
                fleet.clear(partition)
                raise
        except BaseException as e:
            if not plane_lost(e):  # a dead plane has nothing to clear, and answers nothing
                fleet.clear_failed(made, e)  # once the rounds' other calls have ended
            raise
        for part in made:
            fleet.clear(part)
        # the summaries of every generated sample, where they are written before the filter (the
        # trained ones are the filter's choice: their score says little about the policy's accuracy)
        gen_means = {f"generated/{name}/mean": sum(vals.values()) / len(vals)
                     for col, name in self.plan.summaries.items()
                     if (vals := rec.summaries.get(col)) and col in self.plan.columns
                     and self.plan.columns[col].producer in rf.round_ops and self.plan.columns[col].producer != rf.op}
        at = {(part, r): i for i, (part, r) in enumerate((part, r) for part, rs, _ in kept for r in rs)}
        rec.summaries = {col: {at[key]: v for key, v in vals.items() if key in at}
                         for col, vals in rec.summaries.items()}
        try:
            sched = StepScheduler(self.plan, uids, is_padding, step, runner.schedule, None, slots=runner.slots,
                                  gated=runner.window.gated_ops(), row_nodes=row_nodes, rank_nodes=fleet.node_of,
                                  carried=(rf.carried, range(n_kept), rf.round_ops))
        except BaseException:
            fleet.clear(partition)
            raise
        key = StepKey(step)
        runner.window.admit(key, sched)
        runner.reporter.step_started(step, sched.chunk_counts())
        lv = LiveStep(key, partition, sched, is_padding, t0, bytes0, rec=rec, quiet=frozenset(rf.round_ops))
        lv.refill = {"real": real, "dropped": reasons, "metrics": {
            "refill/rounds": rounds, "refill/generated_groups": generated, "refill/kept_groups": len(kept),
            "refill/exhausted": float(exhausted), **gen_means}}
        return lv

    def _exhausted(self, step: int, rounds: int, kept: int, generated: int, reasons: dict[str, int]) -> None:
        """The rounds ran out before the kept groups filled the batch: fail, or say so once and train."""
        rf, want = self.plan.refill, self.plan.batch.batch_size
        what = (f"step {step}: dynamic sampling kept {kept} of the {want} groups a batch needs after {rounds} "
                f"round(s) ({generated} groups generated; {reasons.get('zero_variance', 0)} samples dropped for "
                f"zero variance)")
        if rf.on_exhaust == "fail":
            raise RefillExhausted(f"{what}. Fix: raise {rf.op}.max_rounds, lower {rf.op}.min_std, use prompts of a "
                                  f"difficulty the policy sometimes solves, or set {rf.op}.on_exhaust=train to train "
                                  f"on the groups kept")
        if not self._said_exhausted:
            self._said_exhausted = True
            warnings.warn(f"{what}; training on the groups kept ({rf.op}.on_exhaust=train; raise {rf.op}.max_rounds "
                          f"to fill the batch). Later steps that run out are counted in refill/exhausted", stacklevel=2)
