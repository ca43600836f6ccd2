"""Per-step bookkeeping: which rows have which columns, and which work each op may start.

This is the scheduler's brain and holds metadata only (row ids, never tensors), so it is
tested without Ray. The unit of work is a **chunk**: a fixed list of rows decided before the
step starts, the same under every schedule:

- ``stream`` ops (per sample): consecutive rows, ``micro_batch_size`` per chunk;
- ``group`` ops: ``micro_batch_size`` complete groups per chunk (1 group if unset);
- ``barrier`` ops: one chunk of every row, split over the group's ranks when it runs.

Because chunks do not depend on the order in which rows become ready, ``stream`` and ``sync``
make exactly the same op calls on exactly the same rows, only at different times; with ops
seeded per chunk (not per call order) the two schedules give identical results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from rlgraph.graph.plan import OpPlan, Plan

__all__ = ["Chunk", "StepBook", "make_chunks"]


@dataclass(frozen=True)
class Chunk:
    """One unit of work: an op on a fixed list of rows. ``index`` seeds the op's randomness."""

    op: str
    index: int
    rows: tuple[int, ...]


def make_chunks(op: OpPlan, uids: Sequence[int]) -> list[Chunk]:
    """Split the step's rows into the op's chunks. `uids[i]` is row i's group id; rows of one
    group are contiguous (the source lays them out that way)."""
    n_rows = len(uids)
    if op.mode == "barrier":
        return [Chunk(op.name, 0, tuple(range(n_rows)))]
    size = op.batching.micro_batch_size or 0
    if op.mode == "stream":
        size = size or n_rows or 1
        return [Chunk(op.name, k, tuple(range(s, min(s + size, n_rows))))
                for k, s in enumerate(range(0, n_rows, size))]
    groups: list[list[int]] = []
    for row, uid in enumerate(uids):
        if groups and uids[groups[-1][0]] == uid:
            groups[-1].append(row)
        else:
            groups.append([row])
    per = size or 1
    return [Chunk(op.name, k, tuple(r for grp in groups[s:s + per] for r in grp))
            for k, s in enumerate(range(0, len(groups), per))]


@dataclass
class _OpState:
    op: OpPlan
    chunks: list[Chunk]
    pending: list[int]  # chunk indices not yet started, in order
    running: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    skipped: bool = False

    @property
    def finished(self) -> bool:
        return self.skipped or len(self.done) == len(self.chunks)


class StepBook:
    """Readiness of (row, column) and progress of every op for one step.

    ``schedule="stream"``: an op's chunk may start as soon as its rows have the op's inputs.
    ``schedule="sync"``: additionally, an op may start only once every op of earlier stages
    has finished (a barrier after each stage, like the classic single-controller trainer).
    """

    def __init__(self, plan: Plan, uids: Sequence[int], step: int, schedule: str = "stream",
                 source_columns: Iterable[str] | None = None) -> None:
        if schedule not in ("stream", "sync"):
            raise ValueError(f"schedule must be 'stream' or 'sync', got {schedule!r}")
        self.plan = plan
        self.schedule = schedule
        self.step = step
        self.num_rows = len(uids)
        cols = source_columns if source_columns is not None else [
            c for c, cp in plan.columns.items() if cp.producer == plan.source
        ]
        # column -> rows that have it; source columns exist for every row from the start
        self.ready: dict[str, set[int]] = {c: set(range(self.num_rows)) for c in cols}
        self.ops: dict[str, _OpState] = {}
        for op in plan.ops:
            chunks = make_chunks(op, uids)
            self.ops[op.name] = _OpState(op, chunks, list(range(len(chunks))),
                                         skipped=step < op.skip_before_step)
        self._stage_of = {op.name: op.stage for op in plan.ops}

    # ------------------------------------------------------------------ queries
    def _inputs_ready(self, op: OpPlan, rows: tuple[int, ...]) -> bool:
        for col in op.inputs:
            have = self.ready.get(col)
            if have is None or not have.issuperset(rows):
                return False
        return True

    def _stage_open(self, op: OpPlan) -> bool:
        if self.schedule == "stream":
            return True
        return all(st.finished for st in self.ops.values() if self._stage_of[st.op.name] < op.stage)

    def runnable(self, op_name: str) -> list[Chunk]:
        """Chunks of `op_name` whose inputs are ready and which have not been started."""
        st = self.ops[op_name]
        if st.skipped or not st.pending or not self._stage_open(st.op):
            return []
        return [st.chunks[k] for k in st.pending if self._inputs_ready(st.op, st.chunks[k].rows)]

    def all_runnable(self) -> list[Chunk]:
        """Every startable chunk, ops in plan order, chunks in row order."""
        return [c for name in self.ops for c in self.runnable(name)]

    @property
    def finished(self) -> bool:
        return all(st.finished for st in self.ops.values())

    def unfinished(self) -> dict[str, str]:
        """Op -> a short description of what it still waits for (for timeout messages)."""
        out = {}
        for name, st in self.ops.items():
            if st.finished:
                continue
            missing = [c for c in st.op.inputs if len(self.ready.get(c, ())) < self.num_rows]
            out[name] = (f"{len(st.done)}/{len(st.chunks)} chunks done, {len(st.running)} running"
                         + (f", waiting for columns {missing}" if missing else ""))
        return out

    # ------------------------------------------------------------------ updates
    def start(self, chunk: Chunk) -> None:
        st = self.ops[chunk.op]
        st.pending.remove(chunk.index)
        st.running.add(chunk.index)

    def complete(self, chunk: Chunk) -> None:
        """Record that `chunk` finished: its op's outputs now exist for its rows."""
        st = self.ops[chunk.op]
        st.running.discard(chunk.index)
        st.done.add(chunk.index)
        for col in st.op.outputs:
            if self.plan.columns[col].level == "sample":
                self.ready.setdefault(col, set()).update(chunk.rows)
            elif st.finished:
                self.ready[col] = set(range(self.num_rows))

    def retry(self, chunk: Chunk) -> None:
        """Put a started chunk back (its worker died); it will be handed out again."""
        st = self.ops[chunk.op]
        st.running.discard(chunk.index)
        if chunk.index not in st.pending:
            st.pending.insert(0, chunk.index)

