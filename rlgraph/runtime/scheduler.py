"""The step scheduler: which op call runs next, on which rank. Metadata only, no Ray.

It holds one step's bookkeeping and the dispatch policy, and is driven as an event loop by
`rlgraph.runtime.runner`: completions in (`rows_done`, `call_done`, `drop`), calls out
(`next_calls`). Everything here is row ids and counters, so it is tested without Ray, the way
the compiler passes are.

**Chunks.** The unit of work is a chunk: a fixed list of rows decided before the step, the same
under every schedule:

- ``stream`` ops (per sample): consecutive rows, ``micro_batch_size`` per chunk;
- ``group`` ops: ``micro_batch_size`` complete groups per chunk (1 group if unset);
- ``per_rank`` ops: one chunk per rank, its contiguous share of the rows (whole groups);
- ``barrier`` ops: one chunk of every row, split over the group's ranks when it runs.

Because chunks do not depend on the order in which rows become ready, ``stream`` and ``sync``
make exactly the same op calls on exactly the same rows, only at different times; with ops
seeded per chunk (not per call order) the two schedules give identical results.

**Readiness** is tracked per (column, row) with waiting lists: each chunk counts the input
cells it still misses, and marking rows ready touches only the chunks of the ops that read
those columns on those rows. A completion costs what it unblocks, not the size of the plan.

**Dispatch.** A rank runs one call at a time, and so does a pool's bundle (colocated groups
time-share it). Ready chunks go out in plan order of their ops, chunks in index order; a chunk
goes to the idle rank of its group that has been handed the fewest rows this step (a group of
several ranks is a worker pool); a barrier chunk waits for every rank of its group and is split
into contiguous shards. **Batched calls:** when several chunks of an op (not a barrier, not a
per-rank or streaming op) are ready at once, they go out together: a call takes its share of
the ready chunks over the group's ranks (all of them on one rank, half on two); the worker reads
their inputs with one get, runs the body once per chunk (so results do not change; a vectorised
op's body, which computes each chunk from its own rows, once on all of them) and writes
the outputs with one put. Sixteen ready GRPO groups cost one round trip, not sixteen. Batching
trades overlap for round trips, so an op is batched only when it is cheap (its ``cost`` hint is
below 1: reward, advantage) or nothing on another pool reads its outputs (ref before the update
on the actor): a long op feeding another pool keeps one call per chunk, so its readers start on
the first chunk's rows.
``sync`` additionally holds an op until every op of earlier stages has
finished (a barrier after each stage, like the classic single-controller trainer).
**Queued calls:** an op opened behind a call of the step before (`open` with ``after``,
`rlgraph.runtime.window`) may go to its one rank while that call still runs there: queued behind
it (`Slots.queue`, one per rank), named in ``Call.after`` so the worker can check the order.

**Fused chains** (`rlgraph.graph.fuse`): an op fused into a leader (``OpPlan.fused_into``: ref
after generate on the actor) is never dispatched itself. Its chunks are the leader's, each split
into its own micro-batches, and every call of the leader carries them (``Call.fused``): the
worker runs the followers right after the leader on the same rows, and the call's completion
finishes their chunks too. A step that skips the follower (validation, a warm-up) sends the
leader alone; one that skips the leader dispatches the follower as an op of its own.

**Locality.** On a cluster whose data plane gives rows a home (TransferQueue, one storage unit
per node), `row_homes` lays a step's rows out on the nodes of the *home group*, the group whose
ops read and write the most column bytes: rank k's contiguous share of the rows (the share a
barrier hands it) is stored on a unit on rank k's node. Dispatch then prefers, among a group's
idle ranks, one on the node that stores most of the chunk's rows; it never waits for one, so
locality costs no idle time, and which rank runs a chunk never changes its result.

**Repairs.** `repair_for` decides how a failed call is mended: run it again, restart its group
and run again what the group had in flight, or restore every worker from a checkpoint.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

from rlgraph.graph.plan import OpPlan, Plan

__all__ = ["Chunk", "Call", "Repair", "Slots", "StepScheduler", "call_token", "home_group", "make_chunks", "repair_for",
           "row_homes"]

RAGGED_WEIGHT = 32  # a column with a ragged (per-token) dimension counts as this many scalars


@dataclass(frozen=True)
class Chunk:
    """One unit of work: an op on a fixed list of rows. ``index`` seeds the op's randomness."""

    op: str
    index: int
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Call:
    """One op call to make: one or more ready chunks of an op (or, for a barrier, one rank's shard
    of its chunk) on one rank. The worker runs the body once per chunk (each with its own seed), so
    batching chunks into one call changes no result, only the number of round trips."""

    chunk: Chunk  # the first (or only) chunk
    group: str
    rank: int
    rows: tuple[int, ...]  # the rows this rank handles (a barrier's shard; else its chunks' rows, in order)
    more: tuple[Chunk, ...] = ()  # further chunks of the same op in this call
    # ops fused into this one's calls, in the order they run, each with its chunks on these rows
    fused: tuple[tuple[str, tuple[Chunk, ...]], ...] = ()
    # sent behind the call of an earlier step still running on its rank (`StepScheduler.open`): that
    # call's `call_token`, which the worker checks it ran, and well, before this one ("": none)
    after: str = ""

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return (self.chunk, *self.more)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(chunk index, number of rows) of each chunk in the call, in the order of `rows`."""
        if not self.more:
            return [(self.chunk.index, len(self.rows))]
        return [(c.index, len(c.rows)) for c in self.chunks]


def call_token(partition: str, op: str, chunk: int) -> str:
    """What names a call to the worker it runs on: its step's partition, its op and its first chunk."""
    return f"{partition}/{op}/{chunk}"


def make_chunks(op: OpPlan, uids: Sequence[int], within: Sequence[Chunk] | None = None) -> list[Chunk]:
    """Split the step's rows into the op's chunks. `uids[i]` is row i's group id; rows of one
    group are contiguous (the source lays them out that way). `within`: a fused op's leader's
    chunks, each split into the op's own chunks (numbered on across them)."""
    if within is not None:
        out: list[Chunk] = []
        for lead in within:
            rows = lead.rows
            for c in make_chunks(op, [uids[r] for r in rows]):
                out.append(Chunk(op.name, len(out), tuple(rows[i] for i in c.rows)))
        return out
    n_rows = len(uids)
    if op.mode == "barrier":
        return [Chunk(op.name, 0, tuple(range(n_rows)))]
    if op.mode == "stream":
        starts = list(range(n_rows)) + [n_rows]  # every row is a unit
    else:
        starts = [r for r in range(n_rows) if r == 0 or uids[r] != uids[r - 1]] + [n_rows]  # every group
    units = len(starts) - 1
    if op.batching.per_rank:  # one chunk per rank: the rank's contiguous share of the units
        dp = op.batching.dp
        bounds = [k * units // dp for k in range(dp + 1)]
    else:
        size = op.batching.micro_batch_size or (units if op.mode == "stream" else 1) or 1
        bounds = list(range(0, units, size)) + [units]
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]  # fewer units than ranks: no empty chunks
    return [Chunk(op.name, k, tuple(range(starts[a], starts[b]))) for k, (a, b) in enumerate(spans)]


def home_group(plan: Plan) -> str:
    """The group whose ops read and write the most column bytes per sample (estimated from the
    columns' shapes: a ragged per-token column weighs `RAGGED_WEIGHT` scalars); the first in plan
    order on a tie. Its workers are where a step's rows are best stored."""
    def weight(col: str) -> int:
        c = plan.columns.get(col)
        if c is None or c.level != "sample":
            return 0
        w = 1
        for d in c.shape:
            w *= RAGGED_WEIGHT if isinstance(d, str) else max(int(d), 1)
        return w

    totals: dict[str, int] = {}
    for g in plan.groups:
        totals[g.name] = sum(weight(c) for name in g.ops for c in (*plan.op(name).inputs, *plan.op(name).outputs))
    return max(plan.groups, key=lambda g: totals[g.name]).name


def row_homes(plan: Plan, num_rows: int, rank_nodes: Mapping[tuple[str, int], str],
              unit_nodes: Sequence[str]) -> list[int] | None:
    """The storage unit of each of a step's `num_rows` rows: rank k of the home group gets rows
    ``k*n//dp`` to ``(k+1)*n//dp`` (its barrier shard), stored on a unit of rank k's node
    (round-robin over that node's units), or on unit ``k % units`` when its node has none.
    None when the plane has no units or a rank's node is unknown."""
    if not unit_nodes:
        return None
    group = home_group(plan)
    dp = plan.group(group).dp
    on_node: dict[str, list[int]] = {}
    for u, node in enumerate(unit_nodes):
        on_node.setdefault(node, []).append(u)
    homes = [0] * num_rows
    seen: dict[str, int] = {}
    for k in range(dp):
        node = rank_nodes.get((group, k))
        if node is None:
            return None
        units = on_node.get(node)
        if units:
            unit = units[seen.get(node, 0) % len(units)]
            seen[node] = seen.get(node, 0) + 1
        else:
            unit = k % len(unit_nodes)
        for r in range(k * num_rows // dp, (k + 1) * num_rows // dp):
            homes[r] = unit
    return homes


def _without(chunks: list[Chunk], rows: set[int]) -> list[Chunk]:
    """`chunks` less `rows`, empty ones left out, renumbered."""
    if not rows:
        return chunks
    kept = [tuple(r for r in c.rows if r not in rows) for c in chunks]
    return [Chunk(chunks[0].op, k, rs) for k, rs in enumerate(r for r in kept if r)]


def _fused_this_step(plan: Plan, skipped: Mapping[str, bool], round_ops: Sequence[str]) -> dict[str, str]:
    """Follower -> leader for the fused chains that run this step: a follower is fused when it
    and its leader run on all their rows (neither is skipped, nor one of a refilled batch's round
    ops, which skip the rows brought from the rounds), and so does every chain op it reads from;
    the others run on their own. (A column the chain's call already reads, written outside it, is
    ready when the call starts.)"""
    out: dict[str, str] = {}
    reads: dict[str, set[str]] = {}  # leader -> the columns its call's ops read this step
    source = set(plan.source_columns)
    for op in sorted(plan.ops, key=lambda o: o.stage):
        lead = op.fused_into
        if lead is None or skipped[op.name] or skipped[lead] or op.name in round_ops or lead in round_ops:
            continue
        chain = reads.setdefault(lead, set(plan.op(lead).inputs))
        if all(c in source or c in chain or plan.columns[c].producer in (lead, *(f for f, x in out.items() if x == lead))
               for c in op.inputs):
            out[op.name] = lead
            chain.update(op.inputs)
    return out


class Repair(enum.Enum):
    """How a failed call is mended, cheapest first."""

    RERUN = "rerun"  # call it again on the same rows: its inputs are still in the data plane
    RESTART_GROUP = "restart_group"  # its group died and keeps no state: restart it, re-run its calls
    RESTORE = "restore"  # restore every worker from the latest checkpoint and replay the steps since


def repair_for(plan: Plan, op_name: str, died: bool, stateful: bool, fused: Sequence[str] = ()) -> Repair:
    """The cheapest exact repair of a failed call of `op_name` (with the ops `fused` into it). `died`:
    its worker's process ended; `stateful`: its group keeps state beyond a call (models, optimizers,
    state columns)."""
    # an update (or any call that may have changed worker state before failing) cannot simply run again;
    # nor can a call that carries one (`rlgraph.graph.fuse`: the update closing generation's chain)
    changes_state = any(any(plan.columns[c].kind == "state" for c in op.outputs)
                        or op.batching.mini_batch_samples is not None or (op.mode == "barrier" and stateful)
                        for op in map(plan.op, (op_name, *fused)))
    if died:
        return Repair.RESTORE if stateful else Repair.RESTART_GROUP
    return Repair.RESTORE if changes_state else Repair.RERUN


class Slots:
    """Which bundles of each pool are running a call. One `Slots` is shared by the schedulers of
    all steps in flight, so that two steps never put two calls on one bundle. A bundle may hold
    one call more, queued behind the one it runs (`queue`: a call sent behind its predecessor);
    it stays busy until both ended."""

    def __init__(self, plan: Plan) -> None:
        self.busy: set[tuple[str, int]] = set()  # (pool, bundle index)
        self.running: dict[tuple[str, int], Call | None] = {}  # busy bundle -> the call it runs
        self.queued: dict[tuple[str, int], Call] = {}  # busy bundle -> the call queued behind it
        self.used = {p.name: 0 for p in plan.pools}
        self.size = {p.name: len(p.bundles) for p in plan.pools}

    def take(self, pool: str, rank: int, call: Call | None = None) -> None:
        self.busy.add((pool, rank))
        self.running[(pool, rank)] = call
        self.used[pool] += 1

    def queue(self, pool: str, rank: int, call: Call) -> None:
        self.queued[(pool, rank)] = call

    def free(self, pool: str, rank: int) -> None:
        if (pool, rank) in self.queued:  # the queued call runs now
            self.running[(pool, rank)] = self.queued.pop((pool, rank))
            return
        self.busy.discard((pool, rank))
        self.running.pop((pool, rank), None)
        self.used[pool] -= 1


class _Op:
    """Per-op state of one step."""

    __slots__ = ("plan", "order", "chunks", "chunk_of", "missing", "ready", "parts_left", "started", "done",
                 "skipped", "pool", "leader", "by_leader", "followers")

    def __init__(self, plan: OpPlan, order: int, chunks: list[Chunk], num_rows: int, pool: str, skipped: bool):
        self.plan = plan
        self.order = order  # position in the plan: dispatch priority
        self.chunks = chunks
        self.chunk_of = [-1] * num_rows  # row -> index of the chunk holding it (-1: none, a refilled batch)
        for c in chunks:
            for r in c.rows:
                self.chunk_of[r] = c.index
        self.missing = [0] * len(chunks)  # chunk -> input cells not yet ready
        self.ready: list[int] = []  # heap of chunk indices whose inputs are all ready, not started
        self.parts_left: dict[int, int] = {}  # started chunk -> calls still running
        self.started = 0
        self.done = 0
        self.skipped = skipped
        self.pool = pool
        self.leader: str | None = None  # fused into this op's calls this step (never dispatched itself)
        self.by_leader: dict[int, list[int]] = {}  # a follower's chunks inside each of its leader's chunks
        self.followers: list[_Op] = []  # a leader's followers this step, in the order they run

    @property
    def finished(self) -> bool:
        return self.skipped or self.done == len(self.chunks)


class StepScheduler:
    """One step's op calls: what is ready, what runs where, what is done.

    `uids` and `is_padding` describe the rows as the source laid them out; `ops` restricts the
    step to those ops (validation), the others are skipped like ops gated by a warm-up. `slots`:
    the bundles shared with the other steps in flight (default: this step's own). `gated`: ops
    whose chunks are held, ready or not, until `open` is called for them (their cross-step
    conditions, `rlgraph.runtime.window`, are not met yet). `row_nodes` (the node storing each
    row) and `rank_nodes` (the node of each (group, rank), read at dispatch, so a restarted
    worker's new node counts): dispatch prefers idle ranks near a chunk's rows. `batch_calls`:
    ready chunks of an op go out together (see the module's Dispatch); False gives one call per chunk.
    """

    def __init__(self, plan: Plan, uids: Sequence[int], is_padding: Sequence[bool], step: int,
                 schedule: str = "stream", ops: set[str] | None = None, slots: Slots | None = None,
                 gated: set[str] | frozenset[str] = frozenset(), row_nodes: Sequence[str] | None = None,
                 rank_nodes: Mapping[tuple[str, int], str] | None = None,
                 carried: tuple[Sequence[str], Sequence[int], Sequence[str]] | None = None,
                 batch_calls: bool = True) -> None:
        if schedule not in ("stream", "sync"):
            raise ValueError(f"schedule must be 'stream' or 'sync', got {schedule!r}")
        self.plan = plan
        self.step = step
        self.schedule = schedule
        self.batch_calls = batch_calls
        self._batching: dict[str, bool] = {}  # op -> whether its ready chunks go out together
        self.uids = list(uids)
        self.is_padding = [bool(p) for p in is_padding]
        self.num_rows = n = len(self.uids)
        self._row_nodes = list(row_nodes) if row_nodes is not None and rank_nodes is not None else None
        self._rank_nodes = rank_nodes if rank_nodes is not None else {}
        self._home: dict[tuple[str, int], str] = {}  # (op, chunk index) -> the node storing most of its rows
        self.dropped: dict[int, tuple[str, str]] = {}  # row -> (reason, op that dropped it)
        groups = {g.name: g for g in plan.groups}
        self._dp = {g.name: g.dp for g in plan.groups}
        self._pool = {g.name: g.pool for g in plan.groups}
        # a refilled batch (dynamic sampling): `carried` = (columns, rows, ops): the rows brought from
        # the rounds hold those columns already; the ops (the rounds' ops) run on the other rows only
        carried_cols, carried_rows, round_ops = carried or ((), (), ())
        elsewhere = set(carried_rows)
        self.ops: dict[str, _Op] = {}
        skips = {op.name: step < op.skip_before_step or (ops is not None and op.name not in ops) for op in plan.ops}
        leads = _fused_this_step(plan, skips, round_ops)
        order = {op.name: k for k, op in enumerate(plan.ops)}
        # leaders (and unfused ops) first: a follower's chunks are made inside its leader's
        for op in sorted(plan.ops, key=lambda o: (o.name in leads, o.stage, order[o.name])):
            lead = self.ops[leads[op.name]] if op.name in leads else None
            chunks = make_chunks(op, self.uids, lead.chunks if lead is not None else None)
            if op.name in round_ops:
                chunks = _without(chunks, elsewhere)
            st = _Op(op, order[op.name], chunks, n, groups[op.group].pool, skips[op.name])
            if lead is not None:
                st.leader = lead.plan.name
                lead.followers.append(st)  # in stage order: the order they run in
                for c in chunks:
                    st.by_leader.setdefault(lead.chunk_of[c.rows[0]], []).append(c.index)
            self.ops[op.name] = st
        self.ops = {op.name: self.ops[op.name] for op in plan.ops}  # plan order
        # column -> the ops (not skipped) that read it; each of their chunks counts its missing cells
        self._readers: dict[str, list[_Op]] = {}
        source = set(plan.source_columns)
        for st in self.ops.values():
            if not st.skipped and st.leader is None:  # a follower's inputs come with its leader's call
                for c in st.plan.inputs:
                    if c not in source:
                        self._readers.setdefault(c, []).append(st)
        self._have = {c: bytearray(n) for c in self._readers}  # column -> row -> ready?
        self._have_count = dict.fromkeys(self._readers, 0)
        present = [(c, carried_rows) for c in carried_cols]
        # an op left with no rows (a round's op when the batch has no padding rows) is done: its
        # batch-level outputs are there for whoever reads them
        present += [(c, range(n)) for st in self.ops.values() if not st.skipped and not st.chunks
                    for c in st.plan.outputs if plan.columns[c].level == "batch"]
        for c, rows in present:
            if c in self._have:
                for r in rows:
                    self._have[c][r] = 1
                self._have_count[c] = sum(self._have[c])
        for st in self.ops.values():
            if not st.skipped and st.leader is None:
                waits = [c for c in st.plan.inputs if c not in source]
                for ch in st.chunks:
                    st.missing[ch.index] = (sum(1 for c in waits for r in ch.rows if not self._have[c][r]) if present
                                            else len(waits) * len(ch.rows))
        # dispatch state: busy bundles, rows handed to each rank, ops with ready chunks per pool
        self.slots = slots or Slots(plan)
        self._gated = {name for name in gated if not self.ops[name].skipped and self.ops[name].leader is None}
        self._parked: dict[str, list[int]] = {}  # gated op -> chunks released while it was gated
        # op opened behind a call of the step before -> (that call, its `call_token`)
        self._behind: dict[str, tuple[Call, str]] = {}
        self._running: dict[tuple[str, int], Call] = {}  # (group, rank) -> this step's call running there
        self._sent = {(g.name, r): 0 for g in plan.groups for r in range(g.dp)}
        self._waiting: dict[str, list[int]] = {p.name: [] for p in plan.pools}  # pool -> sorted op orders
        self._by_order = list(self.ops.values())
        # sync: ops of a stage are held until every op of earlier stages has finished
        self._left_in_stage: dict[int, int] = {}
        for st in self.ops.values():
            if not st.finished:
                self._left_in_stage[st.plan.stage] = self._left_in_stage.get(st.plan.stage, 0) + 1
        self._held: dict[int, list[tuple[_Op, int]]] = {}
        self._open = self._open_stage()
        self._ops_left = sum(self._left_in_stage.values())
        for st in self.ops.values():
            if not st.skipped and st.leader is None:
                for ch in st.chunks:
                    if st.missing[ch.index] == 0:
                        self._release(st, ch.index)

    # ------------------------------------------------------------------ queries
    @property
    def finished(self) -> bool:
        return self._ops_left == 0

    def chunk_counts(self) -> dict[str, int]:
        """Op -> its number of chunks this step (ops that run only)."""
        return {name: len(st.chunks) for name, st in self.ops.items() if not st.skipped}

    def single_rank_rows(self, op: str) -> tuple[int, ...] | None:
        """Every row `op` runs on this step, in chunk order, when all of them go to one rank (its
        group has one): what that worker may read ahead for its calls (`rlgraph.runtime.fleet.Fleet.read_ahead`).
        None for a group of several ranks (the rank of a chunk is chosen at dispatch), an op fused
        into another's calls, or one that does not run."""
        st = self.ops.get(op)
        if st is None or st.skipped or st.leader is not None or not st.chunks or self._dp[st.plan.group] != 1:
            return None
        return tuple(r for c in sorted(st.chunks, key=lambda c: c.index) for r in c.rows)

    def unfinished(self) -> dict[str, str]:
        """Op -> a short description of what it still waits for (for timeout messages)."""
        out = {}
        for name, st in self.ops.items():
            if st.finished:
                continue
            missing = [c for c in st.plan.inputs if self._have_count.get(c, self.num_rows) < self.num_rows]
            running = sum(1 for left in st.parts_left.values() if left)
            if st.leader is not None:
                out[name] = f"{st.done}/{len(st.chunks)} chunks done, {running} running, inside {st.leader}'s calls"
                continue
            out[name] = (f"{st.done}/{len(st.chunks)} chunks done, {running} running"
                         + (f", waiting for columns {missing}" if missing else "")
                         + (", held for an earlier step (rlgraph.runtime.window)" if name in self._gated else ""))
        return out

    def tags(self, op: str, rows: Sequence[int]) -> tuple[bool, ...]:
        """Padding tags of `rows` for a call of `op`: padding rows, and rows dropped by an op upstream."""
        return tuple(self.is_padding[i] or (i in self.dropped and op in self._downstream(self.dropped[i][1]))
                     for i in rows)

    def _downstream(self, op: str) -> list[str]:
        return self.ops[op].plan.downstream

    # ------------------------------------------------------------------ dispatch
    def next_calls(self) -> list[Call]:
        """The calls to start now (ready chunks onto idle ranks, or behind the call an op was opened
        behind); they count as running."""
        calls: list[Call] = []
        for name in list(self._behind):
            st = self.ops[name]
            if st.ready:
                calls += self._assign(st)
            if st.started == len(st.chunks):
                del self._behind[name]
        for pool, orders in self._waiting.items():
            i = 0
            while i < len(orders) and self.slots.used[pool] < self.slots.size[pool]:
                st = self._by_order[orders[i]]
                calls += self._assign(st)
                if st.ready:
                    i += 1
                else:
                    orders.pop(i)
        return calls

    def _assign(self, st: _Op) -> list[Call]:
        group, dp = st.plan.group, self._dp[st.plan.group]
        free = [r for r in range(dp) if (st.pool, r) not in self.slots.busy]
        after = ""  # the call this one is queued behind, on its one rank: while that one runs there
        behind = self._behind.get(st.plan.name)
        if (not free and behind is not None and self.slots.running.get((st.pool, 0)) is behind[0]
                and (st.pool, 0) not in self.slots.queued):
            free, after = [0], behind[1]
        calls: list[Call] = []
        # ready chunks shared over the group's ranks (not only the idle ones: a rank freed a moment
        # later still gets its share, so a batched call never holds back a group's parallelism)
        share = -(-len(st.ready) // dp) if self._batches(st) else 1
        while st.ready and free:
            if st.plan.mode == "barrier":
                if len(free) < dp:
                    break
                chunk = st.chunks[heapq.heappop(st.ready)]
                n = len(chunk.rows)
                parts = [(r, chunk.rows[r * n // dp:(r + 1) * n // dp]) for r in range(dp)]
                more: tuple[Chunk, ...] = ()
            else:
                chunk, *rest = [st.chunks[heapq.heappop(st.ready)] for _ in range(min(share, len(st.ready)))]
                more = tuple(rest)
                home = self._chunk_home(chunk)
                parts = [(min(free, key=lambda r: (home is not None and self._rank_nodes.get((group, r)) != home,
                                                   self._sent[(group, r)], r)),
                          chunk.rows + tuple(r for c in more for r in c.rows))]
            for c in (chunk, *more):
                st.parts_left[c.index] = len(parts)
            st.started += 1 + len(more)
            fused = self._fused(st, (chunk, *more))
            for rank, rows in parts:
                free.remove(rank)
                call = Call(chunk, group, rank, rows, more, fused, after)
                if after:
                    self.slots.queue(st.pool, rank, call)
                else:
                    self.slots.take(st.pool, rank, call)
                self._sent[(group, rank)] += len(rows)
                calls.append(call)
                self._running[(group, rank)] = call
        return calls

    @staticmethod
    def _fused(st: _Op, chunks: tuple[Chunk, ...]) -> tuple[tuple[str, tuple[Chunk, ...]], ...]:
        """The followers' chunks on the rows of `chunks` of leader `st`; they count as running."""
        out = []
        for f in st.followers:
            mine = tuple(f.chunks[j] for c in chunks for j in f.by_leader.get(c.index, ()))
            for c in mine:
                f.parts_left[c.index] = 1
            f.started += len(mine)
            if mine:
                out.append((f.plan.name, mine))
        return tuple(out)

    def _batches(self, st: _Op) -> bool:
        """Whether ready chunks of `st` go out together (see the module's Dispatch)."""
        name = st.plan.name
        if name not in self._batching:
            self._batching[name] = self.batch_calls and self.plan.batches_calls(name)
        return self._batching[name]

    def _chunk_home(self, chunk: Chunk) -> str | None:
        """The node storing most of `chunk`'s rows (the first such node on a tie); None without locality."""
        if self._row_nodes is None:
            return None
        key = (chunk.op, chunk.index)
        if key not in self._home:
            counts: dict[str, int] = {}
            for r in chunk.rows:
                counts[self._row_nodes[r]] = counts.get(self._row_nodes[r], 0) + 1
            self._home[key] = max(counts, key=counts.__getitem__) if counts else None
        return self._home[key]

    # ------------------------------------------------------------------ events
    def rows_done(self, op: str, rows: Sequence[int]) -> None:
        """`op`'s per-sample outputs now exist for `rows` (a finished chunk, or part of a running call)."""
        st = self.ops[op]
        for col in st.plan.outputs:
            if self.plan.columns[col].level == "sample":
                self._mark(col, rows)

    def call_done(self, call: Call) -> bool:
        """`call` finished; frees its rank. Returns True when its chunks are done (a barrier's
        chunk: when every shard's call is)."""
        st = self.ops[call.chunk.op]
        self.slots.free(st.pool, call.rank)
        if self._running.get((call.group, call.rank)) is call:
            del self._running[(call.group, call.rank)]
        whole = True
        for c in call.chunks:
            st.parts_left[c.index] -= 1
            if st.parts_left[c.index]:
                whole = False
                continue
            st.done += 1
            self.rows_done(c.op, c.rows)
        if not whole:
            return False
        for name, chunks in call.fused:  # the followers ran on the call's rows, after the leader
            f = self.ops[name]
            for c in chunks:
                f.parts_left[c.index] = 0
                f.done += 1
                self.rows_done(name, c.rows)
            if f.finished and chunks:
                self._op_finished(f)
        if st.finished:
            self._op_finished(st)
        return True

    def _op_finished(self, st: _Op) -> None:
        for col in st.plan.outputs:
            if self.plan.columns[col].level == "batch":
                self._mark(col, range(self.num_rows))
        self._stage_finished(st.plan.stage)

    def drop(self, row: int, reason: str, op: str, whole_group: bool) -> None:
        """`op` dropped `row` (and with `whole_group`, every real row of its group) from training."""
        rows = [r for r in range(self.num_rows) if self.uids[r] == self.uids[row]] if whole_group else [row]
        for r in rows:
            if not self.is_padding[r] and r not in self.dropped:
                self.dropped[r] = (reason, op)

    def _mark(self, col: str, rows: Sequence[int] | range) -> None:
        have = self._have.get(col)
        if have is None:  # nobody reads it this step
            return
        readers = self._readers[col]
        fresh = 0
        for r in rows:
            if have[r]:
                continue
            have[r] = 1
            fresh += 1
            for st in readers:
                k = st.chunk_of[r]
                if k < 0:  # the op does not run on this row (a round's op on a row copied from the rounds)
                    continue
                st.missing[k] -= 1
                if st.missing[k] == 0:
                    self._release(st, k)
        self._have_count[col] += fresh

    def _release(self, st: _Op, k: int) -> None:
        """Chunk `k` of `st` has all its inputs: ready to dispatch, or held until its stage opens."""
        if st.leader is not None:  # runs inside its leader's calls
            return
        if self.schedule == "sync" and st.plan.stage > self._open:
            self._held.setdefault(st.plan.stage, []).append((st, k))
            return
        if st.plan.name in self._gated:
            self._parked.setdefault(st.plan.name, []).append(k)
            return
        heapq.heappush(st.ready, k)
        orders = self._waiting[st.pool]
        i = bisect.bisect_left(orders, st.order)
        if i == len(orders) or orders[i] != st.order:
            orders.insert(i, st.order)

    @property
    def gated(self) -> set[str]:
        """Ops still held for their cross-step conditions."""
        return self._gated

    def open(self, op: str, after: tuple[Call, str] | None = None) -> None:
        """`op`'s cross-step conditions hold: release its held chunks and let later ones through.
        `after`: (a call of the step before, its `call_token`): they hold once that call ends well,
        on the one rank of `op`'s group where it runs: while it runs, `op`'s call may be queued
        behind it there (the worker runs its calls in order, and checks)."""
        if op not in self._gated:
            return
        if after is not None:
            self._behind[op] = after
        self._gated.discard(op)
        for k in self._parked.pop(op, []):
            self._release(self.ops[op], k)

    def rerun(self, call: Call) -> Call:
        """`call`, sent again after it failed (`rlgraph.runtime.recovery`): as it was, but queued behind
        nothing (the call it was queued behind ran before its first attempt), in place of it here."""
        if not call.after:
            return call
        again = dataclasses.replace(call, after="")
        if self._running.get((call.group, call.rank)) is call:
            self._running[(call.group, call.rank)] = again
        bundle = (self._pool[call.group], call.rank)
        if self.slots.running.get(bundle) is call:
            self.slots.running[bundle] = again
        return again

    def lone_call(self, group: str) -> Call | None:
        """The call of `group` running on its one rank when nothing else of `group` is left in this
        step: every op of the group finished or runs its last chunks in that call. A call of the
        next step may be queued behind it (`Window`)."""
        call = self._running.get((group, 0))
        if call is None or self._dp[group] != 1:
            return None
        inside = {call.chunk.op: len(call.chunks), **{name: len(chunks) for name, chunks in call.fused}}
        for name, st in self.ops.items():
            if st.plan.group == group and not st.finished and st.done + inside.get(name, 0) != len(st.chunks):
                return None
        return call

    def op_finished(self, op: str) -> bool:
        """Whether `op` has finished (or is skipped) this step."""
        return self.ops[op].finished

    def _open_stage(self) -> int:
        """The first stage with an unfinished op (every op before it has finished)."""
        open_ = [s for s, left in self._left_in_stage.items() if left]
        return min(open_) if open_ else max(self._left_in_stage, default=0) + 1

    def _stage_finished(self, stage: int) -> None:
        self._ops_left -= 1
        self._left_in_stage[stage] -= 1
        if self._left_in_stage[stage]:
            return
        self._open = self._open_stage()
        for s in sorted(s for s in self._held if s <= self._open):
            for st, k in self._held.pop(s):
                self._release(st, k)
