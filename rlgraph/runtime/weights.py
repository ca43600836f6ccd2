"""Moving state columns (weights) between worker groups, as the window asks.

A state column written by one group and read by another (the policy written by the update and
read by a separate rollout group; any group with several ranks reading rank 0's copy) crosses
groups as a Ray object reference, worker to worker: the driver keeps the reference by producer
step (`WeightMover.kept`); tensors pass through the driver only for a checkpoint (the older kept
versions) and a restore. `rlgraph.runtime.window` decides which version each
read sees and when a group must be given it; this module carries that out and keeps the versions
a later step, a checkpoint or a restore still needs.
"""

from __future__ import annotations

import time
from typing import Any

from rlgraph.graph.plan import Plan
from rlgraph.runtime.fleet import Fleet
from rlgraph.runtime.scheduler import call_token
from rlgraph.runtime.step import LiveStep, StepKey
from rlgraph.runtime.window import Window

__all__ = ["WeightMover", "VERSIONS"]

VERSIONS = "state_versions"  # the checkpoint entry holding the kept state-column values


class WeightMover:
    """The kept versions of every crossing state column and the weight syncs under way."""

    def __init__(self, plan: Plan, fleet: Fleet, window: Window) -> None:
        self.plan, self.fleet, self.window = plan, fleet, window
        self.kept: dict[tuple[str, int], Any] = {}  # (state column, producer step) -> its value in Ray
        # (column, group) -> [version, calls left, t0, key of the step whose gate waits on it (None: a push)]
        self.syncing: dict[tuple[str, str], list[Any]] = {}

    def produced(self, op: str, step: int) -> None:
        """`op` finished `step`: keep (a reference to) each state column it wrote that another group
        reads, for the steps that will read it (a group reading its own columns needs no copy)."""
        group = self.plan.op(op).group
        for col in self.window.produced(op, step):
            if col in self.window.crossing:
                self.kept[(col, step)] = self.fleet.export_state(group, col)

    def prune(self, next_step: int) -> None:
        """Drop the versions no step from `next_step` on reads any more."""
        for kept in self.window.prunable(next_step):
            self.kept.pop(kept, None)

    def open_gates(self, live: dict[StepKey, LiveStep], inflight: dict[Any, Any]) -> None:
        """Open the ops whose cross-step conditions hold; start the weight syncs they wait for, and
        the pushes of new weights to the groups that take them mid-call (partial rollout)."""
        for col, group, version in self.window.pushes(busy=set(self.syncing)):
            self._start(col, group, version, None, inflight)
        again = True
        while again:
            again = False
            for gate in self.window.gates():
                if gate.sync is None:
                    after = None
                    if gate.after is not None:  # may queue behind the step before's call on the op's one rank
                        prev, call = gate.after
                        after = (call, call_token(live[prev].partition, call.chunk.op, call.chunk.index))
                    live[gate.key].sched.open(gate.op, after)
                    continue
                col, group, version = gate.sync
                if (col, group) in self.syncing:
                    continue
                if version is None:  # back to the initial weights (after a restore): a fresh group has them
                    live[gate.key].rec.restarts += self.fleet.restart([group])
                    self.window.holds_initial(group)
                    again = True  # its gates may open now
                    continue
                self._start(col, group, version, gate.key, inflight)

    def _start(self, col: str, group: str, version: int, key: StepKey | None, inflight: dict[Any, Any]) -> None:
        """Move the value `col` had after producer step `version` into `group` (for the gate of the
        step at `key`; None: a push). Into a group that takes weights mid-call, at once (the control
        thread)."""
        calls = self.fleet.import_state(group, col, self.kept[(col, version)], now=(col, group) in self.window.pushed)
        self.syncing[(col, group)] = [version, len(calls), time.time(), key]
        for ref in calls:
            inflight[ref] = ("sync", col, group)

    def synced(self, waitable: Any, col: str, group: str, live: dict[StepKey, LiveStep]) -> None:
        """One rank of a sync finished; once all have, the group holds the version."""
        self.fleet.get([waitable], f"the weight sync of {col!r} to worker group {group!r}")
        entry = self.syncing[(col, group)]
        entry[1] -= 1
        if entry[1] == 0:
            del self.syncing[(col, group)]
            self.window.holds(col, group, entry[0])
            if entry[3] is not None and entry[3] in live:
                live[entry[3]].rec.sync_s += time.time() - entry[2]

    def checkpoint_entry(self) -> dict[str, Any]:
        """The kept versions later steps still read: the latest by producer step (its value is in
        the producer's own state) and the older ones by value."""
        kept = {c: steps for c, steps in self.window.kept.items() if steps and c in self.window.crossing}
        older = {c: dict(zip(map(str, steps[:-1]), self.fleet.get([self.kept[(c, s)] for s in steps[:-1]],
                                                                   f"older versions of {c!r} for the checkpoint")))
                 for c, steps in kept.items() if len(steps) > 1}
        return {"latest": {c: steps[-1] for c, steps in kept.items()}, "older": older}

    def restore(self, entry: dict[str, Any] | None, states: dict[str, Any]) -> None:
        """Refill the kept versions from a checkpoint's `entry` (and its actors' `states`); every
        group then holds something unknown, so each read syncs first."""
        import ray

        entry = entry or {"latest": {}, "older": {}}
        self.forget()
        for c, steps in self.window.kept.items():
            if c not in self.window.crossing:
                continue
            for s, value in sorted(entry["older"].get(c, {}).items(), key=lambda kv: int(kv[0])):
                steps.append(int(s))
                self.kept[(c, int(s))] = ray.put(value)
            if c in entry["latest"]:  # the producer's own copy, in its group's rank 0 state
                s = int(entry["latest"][c])
                steps.append(s)
                producer = self.plan.op(self.plan.columns[c].producer).group
                self.kept[(c, s)] = ray.put(states[f"{producer}_0"]["columns"][c])
        self.window.reset_held(initial=False)

    def forget(self) -> None:
        """No kept versions any more (a restore refills them; a restart from scratch needs none)."""
        self.kept.clear()
        self.window.forget_kept()

    def abandon(self) -> None:
        """The steps in flight were given up: no sync is under way any more."""
        self.syncing.clear()
