"""Steps in flight: which op of which step may start, and which weights it must see. No Ray.

With ``trainer.max_staleness = k`` the runner keeps up to k+1 steps in flight, each with its own
`StepScheduler`. Inside a step the scheduler orders the calls by their columns; across steps the
order comes from the state columns (weights) and is decided here, the same way every run, so
that results never depend on timing:

- **Versions.** An op of step t that reads a state column reads the value its producer wrote at
  step ``t - 1 - lag``, where ``lag`` is the op's (``OpPlan.lag``: k for the behaviour policy,
  `generate`, declared ``stale_ok``; 0 for every other op). If the producer was skipped at that
  step (a warm-up), the latest earlier value; before any, the initial one. The op waits until
  that value exists, and until its group holds exactly that value: the runner then moves it
  there (`Gate.sync`; a group that must go back to the initial value, after a restore, is
  restarted) and opens the op. A group that writes the column itself reads its own latest value.
- **Partial rollout.** A stale_ok op with ``partial`` (``rollout.partial``) reads the newest value
  written before its step, at least the one above; its group is given each new value as soon as
  it is written, also while it runs (the op may switch to it mid-call). Which value a call uses
  then depends on timing: the one exception to the rule above, and an opt-in.
- **Order inside a stateful group.** A group that keeps state (a model, an optimizer, state
  columns) runs its steps in order: no op of it starts step t before every op of it finished
  step t-1. Its state then changes in the same order whatever the timing. On a group of one
  rank, step t's first call may be sent while the group's last call of step t-1 still runs, when
  that call carries the update and writes no state another group reads: queued behind it on
  the worker (`Gate.after`), which runs its calls in order and checks that the one before
  ended well; the driver's hand-off between the two is gone, and the order, with it the
  results, is the same.

A step's partition, scheduler and record live until the step and every earlier one finished;
steps complete in order. Weights a future step may still need are kept by producer step
(`Window.kept`) until no step in flight or to come can read them; checkpoints save them, so a
resume re-runs the steps in flight with the very weights the first run used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from rlgraph.graph.plan import Plan
from rlgraph.runtime.scheduler import Call, Repair, StepScheduler, repair_for
from rlgraph.runtime.step import StepKey

__all__ = ["Gate", "Window", "reads_step"]

_UNKNOWN = "unknown"  # a group's state after a restore: sync it before it is read


@dataclass(frozen=True)
class Gate:
    """What stands between op `op` of the step at `key` and its start. ``sync``: move the value
    that state column `column` had after producer step `version` into group `group` first."""

    key: StepKey
    op: str
    sync: tuple[str, str, int] | None = None  # (column, group, producer step)
    # the call of the step before (its step, the call) that the op's calls may be queued behind
    after: tuple[StepKey, Call] | None = None


def reads_step(step: int, lag: int) -> int:
    """The producer step whose state an op of `step` with `lag` reads (it may be negative: none)."""
    return step - 1 - lag


class Window:
    """The steps in flight and the cross-step facts of the plan."""

    def __init__(self, plan: Plan, stateful: dict[str, bool]) -> None:
        self.plan = plan
        self.live: dict[StepKey, StepScheduler] = {}
        self._reads: dict[StepKey, int | None] = {}  # key -> fixed producer step for every read (validation)
        self.stateful = {g: s for g, s in stateful.items() if s}
        self.lag = {op.name: op.lag for op in plan.ops}
        self.state_cols = {op.name: list(op.state_inputs) for op in plan.ops}
        self.producer = {c: col.producer for c, col in plan.columns.items() if col.kind == "state"}
        self.produces = {op.name: [c for c in op.outputs if c in self.producer] for op in plan.ops}
        self.group_ops = {g.name: list(g.ops) for g in plan.groups}
        self.group_of = {op.name: op.group for op in plan.ops}
        self.kept: dict[str, list[int]] = {c: [] for c in self.producer}  # column -> producer steps kept, sorted
        self.dp = {g.name: g.dp for g in plan.groups}
        # partial rollout: ops that read the newest value written before their step
        self.partial = {op.name for op in plan.ops if op.lag > 0 and op.params.get("partial")}
        # column -> the groups that must be given it (`moves`); only those columns are exported and kept
        self.given_to = {c: {self.group_of[o] for o in plan.columns[c].consumers if self.moves(c, self.group_of[o])}
                         for c in self.producer}
        self.crossing = {c for c, groups in self.given_to.items() if groups}
        # (column, group) pairs given each new value as soon as it is written (partial rollout)
        self.pushed = {(c, self.group_of[o]) for o in self.partial for c in self.state_cols[o]
                       if self.group_of[o] in self.given_to[c]}
        self.held: dict[tuple[str, str], int | None] = {}  # (column, group) -> producer step it holds
        self.reset_held(initial=True)
        self.first = 0  # steps before this are complete (the run started or restored there)

    def forget_kept(self) -> None:
        """No kept versions any more (a restore refills them, a restart from scratch needs none)."""
        for steps in self.kept.values():
            steps.clear()

    # ------------------------------------------------------------------ steps
    def gated_ops(self, reads_fixed: bool = False) -> set[str]:
        """The ops a new step must hold until `gates` says they may start."""
        if reads_fixed:
            return {name for name, cols in self.state_cols.items() if cols}
        return {op.name for op in self.plan.ops if self.state_cols[op.name] or op.group in self.stateful}

    def admit(self, key: StepKey | int, sched: StepScheduler, reads: int | None = None) -> None:
        """The step at `key` (a training step's number, or a `StepKey`) is in flight. `reads`: the
        producer step every state read of this step sees (validation after step s reads step s's
        weights), instead of the per-op rule."""
        key = key if isinstance(key, StepKey) else StepKey(key)
        self.live[key] = sched
        self._reads[key] = reads

    def pop_done(self) -> Iterator[StepKey]:
        """Steps that finished, oldest first, stopping at the first unfinished one."""
        while self.live:
            key = min(self.live)
            if not self.live[key].finished:
                return
            del self.live[key]
            self._reads.pop(key, None)
            yield key

    def clear(self) -> None:
        """Forget every step in flight (a restore)."""
        self.live.clear()
        self._reads.clear()

    # ------------------------------------------------------------------ state versions
    def produced(self, op: str, step: int) -> list[str]:
        """`op` finished step `step`: the state columns it wrote (the runner keeps their values)."""
        cols = self.produces.get(op, [])
        for c in cols:
            if not self.kept[c] or self.kept[c][-1] < step:
                self.kept[c].append(step)
        return cols

    def version_for(self, column: str, upto: int) -> int | None:
        """The latest kept producer step <= `upto` of `column` (None: the initial value)."""
        best = None
        for s in self.kept[column]:
            if s <= upto:
                best = s
        return best

    def prunable(self, next_step: int) -> list[tuple[str, int]]:
        """Kept values no step >= the oldest step in flight (or `next_step`) can read any more."""
        oldest = min([k.step for k in self.live] + [next_step])
        out = []
        for c, steps in self.kept.items():
            lags = [self.lag[o] for o in self.plan.columns[c].consumers] or [0]
            needed = self.version_for(c, reads_step(oldest, max(lags)))
            while steps and needed is not None and steps[0] < needed:
                out.append((c, steps.pop(0)))
        return out

    def holds(self, column: str, group: str, version: int | None) -> None:
        """Group `group` now holds `column` as written at producer step `version`."""
        self.held[(column, group)] = version

    def moves(self, column: str, group: str) -> bool:
        """Whether `group` must be given `column` from its producer: it is another group, or the
        producer's own group with several ranks (each rank reads rank 0's value, as written) unless
        the column is replicated (every rank wrote the same value: data-parallel weights)."""
        producer_group = self.group_of[self.producer[column]]
        return group != producer_group or (self.dp[group] > 1 and not self.plan.columns[column].replicated)

    def holds_initial(self, group: str) -> None:
        """`group` was restarted: it holds the initial value of every state column it reads."""
        for c, groups in self.given_to.items():
            if group in groups:
                self.held[(c, group)] = None

    def reset_held(self, initial: bool) -> None:
        """Every consumer group holds its initial state (`initial`: a fresh start, or every group
        restarted) or something unknown (restored from a checkpoint: sync before reading)."""
        self.held.clear()
        if initial:
            self.held.update({(c, g): None for c, groups in self.given_to.items() for g in groups})

    def pushes(self, busy: set[tuple[str, str]]) -> list[tuple[str, str, int]]:
        """Partial rollout: (column, group, producer step) for each pushed column whose newest value
        its group does not hold yet (`busy`: pairs with a sync under way; they are asked again)."""
        return [(c, g, self.kept[c][-1]) for c, g in sorted(self.pushed)
                if self.kept[c] and (c, g) not in busy and self.held.get((c, g), _UNKNOWN) != self.kept[c][-1]]

    # ------------------------------------------------------------------ gates
    def gates(self) -> list[Gate]:
        """For every gated op of every live step whose cross-step conditions hold: open it
        (``sync`` None) or first sync one state column into its group."""
        out = []
        for key in sorted(self.live):
            sched = self.live[key]
            for op in sorted(sched.gated, key=lambda o: self.plan.op(o).stage):
                gate = self._gate(key, op)
                if gate is not None:
                    out.append(gate)
        return out

    def _finished(self, step: int, op: str) -> bool:
        """`op` finished at training step `step` (steps before the window and those not in flight
        any more count)."""
        key = StepKey(step)
        if step < self.first or key not in self.live:
            return True
        return self.live[key].op_finished(op)

    def _gate(self, key: StepKey, op: str) -> Gate | None:
        group, step = self.group_of[op], key.step
        fixed = self._reads.get(key)
        behind: Call | None = None  # the step before's last call of the group, which op's may queue behind
        if fixed is None and group in self.stateful:
            prev = step - 1
            if StepKey(prev) in self.live and not all(self._finished(prev, o) for o in self.group_ops[group]):
                behind = self._behind(StepKey(prev), group)
                if behind is None:
                    return None
        for c in self.state_cols[op]:
            upto = fixed if fixed is not None else reads_step(step, self.lag[op])
            if upto >= self.first and not self._finished(upto, self.producer[c]):
                # written by that very call (its group's own state, in order on its one rank), or wait
                if behind is None or upto != step - 1 or self.moves(c, group):
                    return None
            if not self.moves(c, group):
                continue  # written here, on its only rank: it holds its own latest value, in order
            version = self.version_for(c, step - 1 if op in self.partial and fixed is None else upto)
            if self.held.get((c, group), _UNKNOWN) != version:
                return None if behind is not None else Gate(key, op, (c, group, version))
        return Gate(key, op, after=(StepKey(step - 1), behind) if behind is not None else None)

    def _behind(self, prev: StepKey, group: str) -> Call | None:
        """The call of step `prev` that `group` runs last, on its one rank, when a call of the next
        step may be queued behind it: nothing else of `group` is left in `prev`
        (`StepScheduler.lone_call`); it carries an op that changes state (the update), so that a
        failure of it restores every worker (`repair_for`) and the call queued behind it is never
        taken for done; and none of its ops writes a state column another group reads (the driver
        exports that value from the worker once the call ended, which a queued call would already
        have changed). The worker runs its calls in the order sent; the queued call checks that
        this one ended well before it starts (`GroupWorker._check_after`)."""
        call = self.live[prev].lone_call(group)
        if call is None:
            return None
        ops = [call.chunk.op, *(name for name, _ in call.fused)]
        if any(c in self.crossing for op in ops for c in self.produces[op]):
            return None
        return call if repair_for(self.plan, ops[0], False, True, ops[1:]) is Repair.RESTORE else None
