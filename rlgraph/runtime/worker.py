"""The worker actor: one per data-parallel rank of a worker group, running that group's ops.

A call carries metadata only (op name, step, chunk index, row ids, padding tags); the worker
reads the op's input columns from the data plane itself, calls the body, writes the outputs
back, and returns a small `CallResult` (timing span, metrics, per-row summaries of a few
columns for accuracy metrics). Tensors never travel through the driver.

State columns (policy weights) stay in the worker that produced them; the driver moves them
between groups as Ray object references when producer and consumer are not colocated.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import traceback
from array import array
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from rlgraph.errors import CallOrderError, InvariantError, OpError
from rlgraph.graph.plan import Plan
from rlgraph.graph.settings import TrainerSettings
from rlgraph.rows import Rows, joined, tensors
from rlgraph.runtime.dataplane import assemble_rows, count_locality, counted_apart, locality_bytes_in_this_process
from rlgraph.runtime.dataplane.local import LocalColumns
from rlgraph.runtime.invoke import Invoker
from rlgraph.runtime.malloc import keep_freed
from rlgraph.runtime.scheduler import call_token
from rlgraph.runtime.actor import READ_AHEAD, CallResult, PartResult, read_ahead_ops  # noqa: F401  # re-exported
from rlgraph.runtime.trace import Span

__all__ = ["CallResult", "GroupWorker", "PartResult", "READ_AHEAD", "read_ahead_ops"]

_READ_AHEAD_KEEP = 4  # partitions whose read-ahead a worker holds at most (a fifth drops the oldest)
_READ_AHEAD_WAIT_S = 60.0  # a call waits this long at most for a read-ahead still running, then reads itself


def _moved_since(before: tuple[int, int]) -> dict[str, int]:
    """A call's local and cross-node column bytes: this process's counts since `before`. (An actor
    runs one op call at a time on its default thread, so the difference is the call's.)"""
    local, remote = locality_bytes_in_this_process()
    return {"local_bytes": local - before[0], "cross_node_bytes": remote - before[1]}


def local_columns(plan: Plan, group: str) -> tuple[frozenset[str], frozenset[str]]:
    """(columns a worker of `group` keeps in memory, those of them it never puts to the data plane).

    It keeps the per-sample data columns it writes that an op of its own group reads. It keeps
    one to itself only when nothing else can need it (a summary or validation column needs no
    plane: the worker sends each row's sum with the call's result), and either
    - every reader is an op fused into the chain that writes it (`rlgraph.graph.fuse`): they run
      in the writer's call, on its rows, and a failed call runs the whole chain again; or
    - every reader is in the group, the group has one rank (so the reader runs where the writer
      did) and keeps state (a death restores from a checkpoint and replays the step, so the value
      is made again), and no dynamic sampling copies rows between partitions."""
    ops = set(plan.group(group).ops)
    kept = frozenset(c.name for c in plan.columns.values()
                     if c.producer in ops and c.level == "sample" and c.kind == "data" and c.stored
                     and any(r in ops for r in c.consumers))
    alone = (plan.group(group).dp == 1 and bool(ops & plan.state_ops()) and plan.refill is None)
    chain = {o.name: o.fused_into or o.name for o in plan.ops}

    def inside_chain(c: str) -> bool:
        col = plan.columns[c]
        return bool(col.consumers) and all(plan.op(r).fused_into == chain[col.producer] for r in col.consumers)

    private = frozenset(c for c in kept if inside_chain(c) or (alone and set(plan.columns[c].consumers) <= ops))
    return kept, private


@dataclass
class _ReadAhead:
    """Columns read for calls before they came (`GroupWorker.read_ahead`): every row of an op on
    this worker, handed out to its calls once per row and column (a call retried reads again)."""

    rows: tuple[int, ...]
    done: threading.Event = field(default_factory=threading.Event)
    values: dict[str, Any] = field(default_factory=dict)
    moved: tuple[int, int] = (0, 0)  # the read's (local, cross-node) bytes, counted for the first call it serves
    served: dict[str, set[int]] = field(default_factory=dict)  # column -> rows handed out
    _at: dict[int, int] | None = None

    def take(self, rows: tuple[int, ...], columns: Sequence[str]) -> dict[str, Any]:
        """`columns` of `rows` as a get of them returns them (all of them: the values as read; some:
        those rows, `assemble_rows`), for each column none of whose `rows` was handed out before."""
        if rows != self.rows:
            if self._at is None:
                self._at = {r: i for i, r in enumerate(self.rows)}
            if any(r not in self._at for r in rows):
                return {}
        out: dict[str, Any] = {}
        for c in columns:
            if c not in self.values or not self.served.setdefault(c, set()).isdisjoint(rows):
                continue
            v = self.values[c]
            if rows == self.rows:
                out[c] = v
            else:
                picks = [self._at[r] for r in rows]
                out[c] = v[picks] if isinstance(v, torch.Tensor) else assemble_rows([v[i] for i in picks])
            self.served[c].update(rows)
        return out

    @property
    def used_up(self) -> bool:
        return all(len(self.served.get(c, ())) == len(self.rows) for c in self.values)


def _private_copy(value: Any) -> Any:
    """A column as read from the plane, for an op of a fused call to keep or be given: its own copy,
    so what one body changes in place never reaches another (as reads from the plane would not).
    Rows that are tensors are cloned one by one (``copy.deepcopy`` of 128 short rows costs ~2 ms,
    a clone each ~0.2 ms); other objects (a json column's dicts) are deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) is Rows and value.flat is not None:  # one clone of the flat tensor, not one a row
        return Rows(value.flat.clone(), value.lengths)
    if not value or isinstance(value[0], (str, bytes, int, float, bool)):
        return list(value)
    if all(type(v) is torch.Tensor for v in value):
        return [v.clone() for v in value]
    return copy.deepcopy(value)


def torch_threads(planned: int) -> int:
    """Set this process's torch threads to the plan's number for its group, capped at the cores the
    process may use (Ray sets OMP_NUM_THREADS to an actor's logical CPUs, 1 for a fraction); returns it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    n = max(1, min(int(planned), cores))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextmanager
def _lent_threads(threads: int, own: int) -> Iterator[None]:
    """`threads` torch threads inside (`torch_threads`), `own` again after."""
    torch_threads(threads)
    try:
        yield
    finally:
        torch_threads(own)


def _slice_rows(inputs: dict[str, Any], a: int, b: int, n: int) -> dict[str, Any]:
    """Rows `a:b` of a call's inputs (each a dense tensor or a list with `n` rows)."""
    if (a, b) == (0, n):
        return inputs
    return {c: v[a:b] for c, v in inputs.items()}


def _concat_outputs(plan: Plan, outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The outputs of the chunks of a batched call as one call's: per-sample columns joined in row
    order (dense tensors of one shape stay dense), every other output as the last chunk gave it."""
    out = dict(outs[-1])
    for c in outs[0]:
        col = plan.columns[c]
        if col.level != "sample" or col.kind != "data":
            continue
        parts = [o[c] for o in outs]
        if all(isinstance(p, torch.Tensor) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
            out[c] = torch.cat(parts)
        else:
            out[c] = [row for p in parts for row in (p.unbind(0) if isinstance(p, torch.Tensor) else p)]
    return out


@dataclass(frozen=True)
class _OpColumns:
    """What a worker does with one op's columns, worked out once from the plan (not at each call): the
    per-sample inputs it reads, the outputs it stores (puts), its metric outputs and those the step summarises."""

    sample_inputs: tuple[str, ...]
    stored: frozenset[str]
    metrics: frozenset[str]
    summed: tuple[str, ...]

    @classmethod
    def of(cls, plan: Plan, op: Any) -> "_OpColumns":
        col = plan.columns
        return cls(sample_inputs=tuple(c for c in op.inputs if col[c].level == "sample"),
                   stored=frozenset(c for c in op.outputs
                                    if col[c].level == "sample" and col[c].kind == "data" and col[c].stored),
                   metrics=frozenset(c for c in op.outputs if col[c].kind == "metric"),
                   summed=tuple(c for c in plan.summaries if c in op.outputs))


def _chunk_metrics(metrics: frozenset[str], op: Any, outs: list[dict[str, Any]], n_chunks: int) -> list[dict[str, Any]]:
    """A call's metric records (`metrics`: the op's metric outputs), one per chunk as the step's metrics
    average them: a vectorised op's metric output is either one record for the call or a list with one per chunk."""
    records = [{c: v for c, v in o.items() if c in metrics} for o in outs]
    if not op.vectorised:
        return records
    per_chunk: list[dict[str, Any]] = [{} for _ in range(n_chunks)]
    for c, v in records[0].items():
        if not isinstance(v, list):
            per_chunk[0][c] = v
            continue
        if len(v) != n_chunks:
            raise OpError(f"op {op.name!r}: metric output {c!r} is a list of {len(v)} records for a call of "
                          f"{n_chunks} chunks; a vectorised op gives one record per chunk (ctx.chunks) or one "
                          f"for the call")
        for record, x in zip(per_chunk, v):
            record[c] = x
    return per_chunk


def _row_sums(value: Any) -> list[float]:
    """Each row's sum, in float64: one reduction for a dense column, and for a list of row tensors one
    ``np.add.reduceat`` over their elements joined (`rlgraph.rows.joined`: a `Rows`'s flat tensor as it
    is), over the rows that have elements (empty rows sum to 0). 128 rows: 12 us, where a scatter-add
    by row took 38 us (1,024 rows: 66 against 292)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(value.shape[0], -1).double().sum(dim=1).tolist()
    if type(value) is Rows and value.flat is not None:
        if value.sums is not None:  # given by the op that made them (`Rows.sums`)
            return value.sums
        rows, sizes = value, value.lengths
    else:
        rows = tensors(value)
        sizes = [r.numel() for r in rows]
    if not rows:
        return []
    # each row's start, through an int64 array (numpy's conversion of a list of ints costs 3x as much)
    starts = np.frombuffer(array("q", accumulate(sizes, initial=0)), dtype=np.int64)[:-1]
    if min(sizes) > 0:  # no empty row (the common case): one reduction from each row's start
        return np.add.reduceat(_numpy_of(joined(rows)), starts, dtype=np.float64).tolist()
    counts = np.frombuffer(array("q", sizes), dtype=np.int64)
    sums = np.zeros(len(counts), dtype=np.float64)
    filled = counts > 0
    if filled.any():
        # each filled row's sum runs from its start to the next filled row's: the empty rows between add nothing
        sums[filled] = np.add.reduceat(_numpy_of(joined(rows)), starts[filled], dtype=np.float64)
    return sums.tolist()


_NUMPY_SUMMED = (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint8)  # summed by numpy as they are; any other (bool, bfloat16, float8, complex) as float64


def _numpy_of(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype not in _NUMPY_SUMMED or t.is_conj() or t.is_neg():
        t = t.double()
    return t.numpy()


class _Failures:
    """`GroupWorker._failures`: a class, not a generator's context manager, as it wraps each op call three
    or four times (a generator's costs several us a use with the caches cold, as after a model's pass)."""

    __slots__ = ("worker", "op_name", "step", "chunk", "rows", "uids")

    def __init__(self, worker: "GroupWorker", op_name: str, step: int, chunk: int, rows: tuple[int, ...],
                 uids: Sequence[int]) -> None:
        self.worker, self.op_name, self.step, self.chunk, self.rows, self.uids = worker, op_name, step, chunk, rows, uids

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> None:
        if e is None or not isinstance(e, Exception):
            return
        keys = list(self.uids[:8]) + (["..."] if len(self.uids) > 8 else [])
        detail = "".join(traceback.format_exception(type(e), e, tb)[-6:])
        error = type(e) if isinstance(e, InvariantError) else OpError  # a bug: the runner must not retry it
        raise error(
            f"op {self.op_name!r} failed on worker {self.worker.group}[{self.worker.rank}] at step {self.step} (chunk "
            f"{self.chunk}, {len(self.rows)} rows, sample uids {keys}): {type(e).__name__}: {e}\n{detail}"
        ) from None


class GroupWorker:
    """Body of the Ray actor (wrapped with ``ray.remote`` by the runner, so it is testable as is)."""

    def __init__(self, plan_json: str, group: str, rank: int, dp: int, handle: Any = None) -> None:
        os.environ.setdefault("TQ_NUM_THREADS", "2")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no per-load bars in every worker's log
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.plan = Plan.model_validate_json(plan_json)
        self.group, self.rank, self.dp = group, rank, dp
        self.torch_threads = torch_threads(self.plan.group(group).torch_threads)
        keep_freed(TrainerSettings.of(self.plan).malloc_keep_mb)  # before the models' tensors (`malloc`)
        self.local = LocalColumns()
        self._ended_well = ""  # the `call_token` of the call that ended last, if it ended well
        self.kept, self.private = local_columns(self.plan, group)
        self._op_columns: dict[str, _OpColumns] = {}  # by op, made at its first call (`_columns`)
        # during a call with fused ops: the columns its ops read from the plane, for its rows (one get),
        # kept for its followers where one reads them (`_wanted`)
        self._call_inputs: dict[str, Any] | None = None
        self._prefetch: list[str] = []
        self._wanted: frozenset[str] = frozenset()
        self._readers: Counter[str] = Counter()
        self.client = handle.connect() if handle is not None else None  # else `connect`, once the plane is up
        self.invoker: Invoker | None = None  # made by setup(), once the group's rendezvous is known
        # reads ahead of calls (`read_ahead`, on a thread of their own): partition -> what was read
        self._ahead: dict[str, _ReadAhead] = {}
        self._forgotten: dict[str, None] = {}  # the partitions forgotten lately (a read ahead of one is dropped)
        self._ahead_lock = threading.Lock()
        self._ahead_served = 0  # columns the op call running now took from a read-ahead

    def connect(self, handle: Any) -> None:
        """Connect to the data plane (a worker started before the plane was ready)."""
        self.client = handle.connect()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0 for its group)."""
        import socket

        import ray

        addr = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return addr, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> str:
        """Import the group's op bodies and instantiate its worker classes (all ranks at once:
        their setup may join a process group). Returns the Ray node this worker runs on."""
        import ray

        from rlgraph import heap

        self.invoker = Invoker(self.plan, self.group, self.rank, self.dp, master_addr, master_port)
        heap.freeze()  # imports and models: out of the collector's full collections
        return ray.get_runtime_context().get_node_id()

    def run_chunk(self, op_name: str, step: int, partition: str, chunks: Sequence[tuple[int, int]],
                  rows: Sequence[int], uids: Sequence[int], is_padding: Sequence[bool],
                  batch_inputs: dict[str, Any] | None = None, salt: int = 0, addresses: Any = None,
                  fused: Sequence[tuple[str, Sequence[tuple[int, int]]]] = (), forget: Sequence[str] = (),
                  after: str = "") -> CallResult:
        """Run `op_name` on `rows`: get its inputs, call the body, put its outputs. `chunks`: the
        (chunk index, number of rows) of each chunk the call holds, in the order of `rows`; the
        inputs are read with one get and the outputs written with one put, and the body runs once
        per chunk, seeded by the chunk, so a batched call gives what one call per chunk would (a
        vectorised op's body runs once on them all: it computes each chunk from its own rows).
        `addresses`: where the rows are in the data plane (`DataPlane.addresses`). `fused`: the ops
        fused into this call (`rlgraph.graph.fuse`), each with its chunks on the same rows: they run
        after it, in order, and their results come in `CallResult.fused`. `forget`: partitions the
        driver cleared since this worker's last call (`forget`, sent with the call: a call of its
        own would run between two of this worker's calls, on the step's critical path). `after`: the
        `call_token` of the call this one was queued behind (`_check_after`)."""
        self._check_after(after, op_name, step)
        self._forget_all(forget)
        rows = tuple(rows)
        self._learn(partition, rows, addresses)
        self._begin_call(op_name, fused)
        try:
            result = self._run(op_name, step, partition, chunks, rows, uids, is_padding, batch_inputs, salt)
            result.fused = self._run_fused(op_name, fused, step, partition, rows, uids, is_padding, salt)
        finally:
            self._end_call()
        self._ended_well = call_token(partition, op_name, chunks[0][0])
        return result

    def _check_after(self, after: str, op_name: str, step: int) -> None:
        """A call queued behind the step before's call (`rlgraph.runtime.window`) runs only right after
        that call ended well here; every call then counts as not ended well until it has."""
        if after and after != self._ended_well:
            raise CallOrderError(f"op {op_name!r} at step {step} on worker {self.group}[{self.rank}] was queued behind "
                                 f"call {after}, which did not end well on this worker just before it (it failed, "
                                 f"or has not run yet): not run")
        self._ended_well = ""

    def _begin_call(self, leader: str, fused: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> None:
        """Before a call of `leader` with the ops `fused` into it: the per-sample columns the
        followers read that the chain does not write, and of those the ones the leader does not read
        (got with the leader's inputs, in one get; the chain's own outputs are in this worker's memory)."""
        if not fused:
            self._end_call()
            return
        names = [name for name, _ in fused]
        made = {c for n in (leader, *names) for c in self.plan.op(n).outputs}
        wanted = [c for n in names for c in self.plan.op(n).inputs
                  if c not in made and self.plan.columns[c].level == "sample"]
        own = set(self.plan.op(leader).inputs)
        self._call_inputs, self._wanted = {}, frozenset(wanted)
        self._readers = Counter(wanted)  # followers yet to read each column
        self._prefetch = list(dict.fromkeys(c for c in wanted if c not in own))

    def _end_call(self) -> None:
        self._call_inputs, self._prefetch, self._wanted, self._readers = None, [], frozenset(), Counter()

    def _from_cache(self, cache: dict[str, Any], column: str) -> Any:
        """A follower's read of `column` from the call's cache: its own copy, or, for the last follower
        to read it, the cache's (which no body was given), taken out of the cache."""
        self._readers[column] -= 1
        return _private_copy(cache[column]) if self._readers[column] > 0 else cache.pop(column)

    def _run(self, op_name: str, step: int, partition: str, chunks: Sequence[tuple[int, int]],
             rows: tuple[int, ...], uids: Sequence[int], is_padding: Sequence[bool],
             batch_inputs: dict[str, Any] | None, salt: int, fused_into: str = "") -> CallResult:
        """`run_chunk` for one op of the call (`fused_into`: the call's op, when this one is fused into it)."""
        start, op = time.time(), self.plan.op(op_name)
        moved = locality_bytes_in_this_process()
        self._ahead_served = 0
        outs: list[dict[str, Any]] = []
        dropped: dict[int, tuple[str, bool]] = {}
        events: list[tuple[float, float, int, str]] = []
        with self._failures(op_name, step, chunks[0][0], rows, uids):
            inputs = self._inputs(op, partition, rows, step, chunks[0][0])
        io_s = time.time() - start
        # a vectorised op's body runs once on all the call's chunks; any other once per chunk
        calls = ([(chunks[0][0], len(rows), tuple(n for _, n in chunks))] if op.vectorised
                 else [(index, n, ()) for index, n in chunks])
        at = 0
        with self._threads(op):
            for index, n, sizes in calls:
                sub = rows[at:at + n]
                with self._failures(op_name, step, index, sub, uids[at:at + n]):
                    outs.append(self.invoker.call(op, step, index, sub, is_padding[at:at + n],
                                                  _slice_rows(inputs, at, at + n, len(rows)), batch_inputs, salt,
                                                  sizes))
                dropped.update({at + i: why for i, why in self.invoker.last_dropped.items()})
                events += self.invoker.last_events
                at += n
        out = outs[0] if len(outs) == 1 else _concat_outputs(self.plan, outs)
        with self._failures(op_name, step, chunks[0][0], rows, uids):  # before the put: a bad list writes nothing
            metrics = _chunk_metrics(self._columns(op_name).metrics, op, outs, len(chunks))
        put_at = time.time()
        self._put(op_name, partition, rows, out)
        end = time.time()
        return CallResult(
            span=Span(op=op_name, group=self.group, rank=self.rank, step=step, chunk=chunks[0][0], rows=len(rows),
                      start=start, end=end, events=tuple(events), io_s=io_s + end - put_at, fused_into=fused_into,
                      read_ahead=self._ahead_served, **_moved_since(moved)),
            metrics=metrics,
            summaries=self._summaries(op_name, out, rows, range(len(rows)), is_padding, dropped),
            batch_values={c: v for o in outs for c, v in o.items()
                          if self.plan.columns[c].level == "batch" and self.plan.columns[c].kind == "data"},
            dropped={rows[i]: why for i, why in dropped.items()},
        )

    def _run_fused(self, leader: str, fused: Sequence[tuple[str, Sequence[tuple[int, int]]]], step: int,
                   partition: str, rows: tuple[int, ...], uids: Sequence[int], is_padding: Sequence[bool],
                   salt: int) -> list[CallResult]:
        """Run the ops fused into `leader`'s call on its rows, in order; a follower reads the
        leader's outputs from this worker's memory (they were just put: `LocalColumns`)."""
        return [self._run(name, step, partition, spans, rows, uids, is_padding, None, salt, leader)
                for name, spans in fused]

    def run_chunk_stream(self, op_name: str, step: int, partition: str, chunk: int, rows: Sequence[int],
                         uids: Sequence[int], is_padding: Sequence[bool],
                         batch_inputs: dict[str, Any] | None = None,
                         salt: int = 0, addresses: Any = None,
                         fused: Sequence[tuple[str, Sequence[tuple[int, int]]]] = (), forget: Sequence[str] = (),
                         after: str = "") -> Iterator[PartResult | CallResult]:
        """`run_chunk` for a streaming op (a Ray streaming generator): puts each part the body
        yields and yields a `PartResult` for it at once, then the call's `CallResult` (after the
        ops fused into the call ran on all its rows)."""
        self._check_after(after, op_name, step)
        self._forget_all(forget)
        try:
            yield from self._stream(op_name, step, partition, chunk, rows, uids, is_padding, batch_inputs, salt,
                                    addresses, fused)
        finally:  # failed, or closed early: the call's reads go with it
            self._end_call()
        self._ended_well = call_token(partition, op_name, chunk)

    def run_chunk_whole(self, *args: Any, **kwargs: Any) -> CallResult:
        """`run_chunk_stream` (same arguments) with one result: for a streaming op whose parts no
        op elsewhere can start on before the call ends (`Fleet.submit`); its parts' summaries join
        the call's. A Ray streaming call reports each part to the driver (on this machine a call of
        two parts took 1.6 ms where a plain call takes 0.9), which then buys nothing."""
        summaries: dict[str, dict[int, float]] = {}
        result = None
        for item in self.run_chunk_stream(*args, **kwargs):  # to its end: the call's clean-up runs before the return
            for column, sums in item.summaries.items():
                summaries.setdefault(column, {}).update(sums)
            if isinstance(item, CallResult):
                result = item
        if result is None:
            raise InvariantError(f"a streaming call of {args[0] if args else kwargs.get('op_name')!r} ended without "
                                 f"its result")
        result.summaries = summaries
        return result

    def _stream(self, op_name: str, step: int, partition: str, chunk: int, rows: Sequence[int],
                uids: Sequence[int], is_padding: Sequence[bool], batch_inputs: dict[str, Any] | None, salt: int,
                addresses: Any, fused: Sequence[tuple[str, Sequence[tuple[int, int]]]]
                ) -> Iterator[PartResult | CallResult]:
        start, op, rows = time.time(), self.plan.op(op_name), tuple(rows)
        self._learn(partition, rows, addresses)
        moved = locality_bytes_in_this_process()
        self._ahead_served = 0
        self._begin_call(op_name, fused)
        with self._failures(op_name, step, chunk, rows, uids):
            inputs = self._inputs(op, partition, rows, step, chunk)
            io_s = time.time() - start
            parts = self.invoker.stream(op, step, chunk, rows, is_padding, inputs, batch_inputs, salt)
        handed: list[tuple[float, int]] = []
        while True:
            with self._failures(op_name, step, chunk, rows, uids):
                part = next(parts, None)
            if part is None:
                break
            positions, out = part
            part_rows = tuple(rows[p] for p in positions)
            put_at = time.time()
            self._put(op_name, partition, part_rows, out)
            handed.append((time.time(), len(part_rows)))
            io_s += handed[-1][0] - put_at
            yield PartResult(part_rows, self._summaries(op_name, out, rows, positions, is_padding, {}))
        dropped = dict(self.invoker.last_dropped)
        rest = self.invoker.last_rest
        result = CallResult(
            span=Span(op=op_name, group=self.group, rank=self.rank, step=step, chunk=chunk, rows=len(rows),
                      start=start, end=time.time(), parts=tuple(handed), events=tuple(self.invoker.last_events),
                      io_s=io_s, read_ahead=self._ahead_served, **_moved_since(moved)),
            metrics=[{c: v for c, v in rest.items() if self.plan.columns[c].kind == "metric"}],
            batch_values={c: v for c, v in rest.items()
                          if self.plan.columns[c].level == "batch" and self.plan.columns[c].kind == "data"},
            dropped={rows[i]: why for i, why in dropped.items()},
        )
        result.fused = self._run_fused(op_name, fused, step, partition, rows, uids, is_padding, salt)
        yield result

    def _threads(self, op: Any) -> AbstractContextManager[None]:
        """While `op`'s body runs: the torch threads the plan gives it, when more than the group's (it
        runs alone on its node: `rlgraph.graph.place.lent_threads`), capped at this process's cores.
        Else nothing to do: a `nullcontext`, without a generator's cost."""
        if op.torch_threads <= self.torch_threads:
            return nullcontext()
        return _lent_threads(op.torch_threads, self.torch_threads)

    def _failures(self, op_name: str, step: int, chunk: int, rows: tuple[int, ...], uids: Sequence[int]) -> "_Failures":
        """Turn anything an op body (or its inputs) raises into an `OpError` naming the call."""
        return _Failures(self, op_name, step, chunk, rows, uids)

    def _learn(self, partition: str, rows: tuple[int, ...], addresses: Any) -> None:
        if addresses is not None and self.client is not None:
            self.client.learn(partition, rows, addresses)

    def read_ahead(self, partition: str, rows: Sequence[int], columns: Sequence[str], addresses: Any = None) -> None:
        """Read `columns` of `rows` of `partition` for a call that has not come yet (on the actor's
        `READ_AHEAD` thread, while the running call computes): the call then takes them instead of
        waiting for a get (`_read`). Planned by the driver when it admits a step, for an op that
        reads only the data source's columns (`read_ahead_ops`), and sent with this worker's next
        call (`rlgraph.runtime.fleet.Fleet.read_ahead`): in a synchronous step, generation waits for
        the update's weights, and its get no longer follows them. A read that fails is left to the
        call, which reads again and reports what fails."""
        ahead = _ReadAhead(tuple(rows))
        with self._ahead_lock:
            if partition in self._forgotten or self.client is None:
                return
            self._ahead[partition] = ahead
            while len(self._ahead) > _READ_AHEAD_KEEP:  # the oldest: done (reads run one at a time, on one thread)
                self._ahead.pop(next(iter(self._ahead)))
        try:
            self._learn(partition, ahead.rows, addresses)
            with counted_apart() as moved:  # counted for the call it serves, not the one running now
                ahead.values = self.client.get(partition, ahead.rows, list(columns))
            ahead.moved = (moved[0], moved[1])
        except Exception:  # noqa: BLE001 - the call reads for itself and names what fails
            ahead.values = {}
        finally:
            ahead.done.set()

    def _read(self, partition: str, rows: tuple[int, ...], columns: list[str]) -> dict[str, Any]:
        """`columns` of `rows`: those read ahead for them (`_ReadAhead.take`), the others from the
        data plane."""
        with self._ahead_lock:
            ahead = self._ahead.get(partition)
        out: dict[str, Any] = {}
        if ahead is not None and ahead.done.wait(_READ_AHEAD_WAIT_S):
            with self._ahead_lock:
                out = ahead.take(rows, columns)
                self._ahead_served += len(out)
                if out and ahead.moved != (0, 0):
                    count_locality(*ahead.moved)
                    ahead.moved = (0, 0)
                if ahead.used_up:
                    self._ahead.pop(partition, None)
        rest = [c for c in columns if c not in out]
        if rest:
            out.update(self.client.get(partition, rows, rest))
        return out

    def _inputs(self, op: Any, partition: str, rows: tuple[int, ...], step: int, chunk: int) -> dict[str, Any]:
        sample_inputs = self._columns(op.name).sample_inputs
        extra, self._prefetch = self._prefetch, []  # the leader of a fused call gets its followers' reads too
        if not (sample_inputs or extra) or not rows:
            return {}
        got = self.local.take(partition, rows, sample_inputs)  # what this worker wrote itself
        cache = self._call_inputs  # None: no fused call; else what this call's earlier ops got, for its rows
        if cache:
            got.update((c, self._from_cache(cache, c)) for c in sample_inputs if c not in got and c in cache)
        rest = [c for c in sample_inputs if c not in got]
        extra = [c for c in extra if c not in got and c not in rest]
        if rest or extra:
            read = self._read(partition, rows, rest + extra)
            got.update((c, read[c]) for c in rest)
            if cache is not None:  # what a follower reads, copied before this op's body runs (its changes stay its own)
                cache.update((c, _private_copy(v) if c in rest else v) for c, v in read.items() if c in self._wanted)
        return got

    def _columns(self, op_name: str) -> _OpColumns:
        cols = self._op_columns.get(op_name)
        if cols is None:
            cols = self._op_columns[op_name] = _OpColumns.of(self.plan, self.plan.op(op_name))
        return cols

    def _put(self, op_name: str, partition: str, rows: tuple[int, ...], out: dict[str, Any]) -> None:
        stored = self._columns(op_name).stored
        put = {c: v for c, v in out.items() if c in stored}
        if not put or not rows:
            return
        keep = {c: v for c, v in put.items() if c in self.kept}
        if keep:
            self.local.keep(partition, rows, keep)
        shared = {c: v for c, v in put.items() if c not in self.private}
        if shared:
            self.client.put(partition, rows, shared)

    def _forget_all(self, partitions: Sequence[str]) -> None:
        for partition in partitions:
            self.forget(partition)

    def forget(self, partition: str) -> None:
        """The driver cleared `partition`: drop what this worker kept of it (sent with this worker's
        next call, `Fleet.clear`, or on its own once a few wait)."""
        self.local.forget(partition)
        with self._ahead_lock:
            self._ahead.pop(partition, None)
            self._forgotten[partition] = None
            while len(self._forgotten) > 256:
                self._forgotten.pop(next(iter(self._forgotten)))
        if self.client is not None:
            self.client.forget(partition)

    def _summaries(self, op_name: str, out: dict[str, Any], rows: tuple[int, ...], positions: Sequence[int],
                   is_padding: Sequence[bool], dropped: dict[int, Any]) -> dict[str, dict[int, float]]:
        """Per summarised column, each real row's sum (`out` holds `op_name`'s rows at `positions`)."""
        summed = [c for c in self._columns(op_name).summed if c in out]
        if not summed:
            return {}
        whole = positions == range(len(rows))  # the call's rows, in order
        if not dropped and not any(is_padding if whole else (is_padding[p] for p in positions)):  # every row real
            keys = rows if whole else [rows[p] for p in positions]
            return {c: dict(zip(keys, _row_sums(out[c]), strict=True)) for c in summed}
        real = [k for k, p in enumerate(positions) if not is_padding[p] and p not in dropped]
        summaries = {}
        for c in summed:
            sums = _row_sums(out[c]) if real else []
            summaries[c] = {rows[positions[k]]: sums[k] for k in real}
        return summaries

    # ------------------------------------------------------------------ state
    def export_state(self, column: str) -> Any:
        return self.invoker.state.get(column)

    def import_state(self, column: str, value: Any) -> None:
        self.invoker.state[column] = value

    def state_columns(self) -> dict[str, Any]:
        return dict(self.invoker.state)

    def load_state_columns(self, values: dict[str, Any]) -> None:
        self.invoker.state.update(values)

    def instance_states(self) -> dict[str, Any]:
        """``state_dict()`` of every worker-class instance that has one (checkpoints)."""
        return {k: inst.state_dict() for k, inst in self.invoker.instances.items()
                if callable(getattr(inst, "state_dict", None))}

    def load_instance_states(self, states: dict[str, Any]) -> None:
        for k, st in states.items():
            inst = self.invoker.instances.get(k)
            if inst is not None and callable(getattr(inst, "load_state_dict", None)):
                inst.load_state_dict(st)

    def has_instance_state(self) -> bool:
        """Whether a worker class here keeps state beyond its op calls: it has a ``state_dict``, and
        its ``keeps_state()``, where it defines one, says so under this run's config (GRPO's advantage
        keeps its KL controller only with the KL term in the reward)."""
        return any(callable(getattr(inst, "state_dict", None))
                   and (not callable(getattr(inst, "keeps_state", None)) or inst.keeps_state())
                   for inst in self.invoker.instances.values())

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        """The end of the run (`rlgraph.runtime.fleet.Fleet.close`, before it kills this actor): close its
        worker classes (`Invoker.close`), then its data-plane client."""
        if self.invoker is not None:
            self.invoker.close()
        if self.client is not None:
            self.client.close()


class FaultInjectingWorker(GroupWorker):
    """`GroupWorker` with the runner's fault-injection hook (`rlgraph.runtime.recovery.Fault`): the
    fleet starts this class instead only when a run is given faults (`RunOptions.faults`, tests), so the calls
    of every other run carry none of it. A call given ``fault``: ``raise`` fails after reading its
    inputs, before the body runs; ``kill`` ends this actor's process before that; ``kill_after``
    ends it once the call's outputs are written, before its result is returned."""

    _fault: str | None = None
    _fault_op: str | None = None  # the op of a fused call the fault is for (None: the call's own)

    def run_chunk(self, *args: Any, fault: str | None = None, fault_op: str | None = None,
                  **kwargs: Any) -> CallResult:
        self._fault, self._fault_op = fault, fault_op
        result = super().run_chunk(*args, **kwargs)
        if fault == "kill_after":
            os._exit(17)
        return result

    def run_chunk_stream(self, *args: Any, fault: str | None = None, fault_op: str | None = None,
                         **kwargs: Any) -> Iterator[PartResult | CallResult]:
        self._fault, self._fault_op = fault, fault_op
        for item in super().run_chunk_stream(*args, **kwargs):
            if fault == "kill_after" and isinstance(item, CallResult):
                os._exit(17)
            yield item

    def _inputs(self, op: Any, partition: str, rows: tuple[int, ...], step: int, chunk: int) -> dict[str, Any]:
        if self._fault_op is not None and op.name != self._fault_op:  # the fault is for an op fused after this one
            return super()._inputs(op, partition, rows, step, chunk)
        fault, self._fault = self._fault, None
        if fault == "kill":
            os._exit(17)
        inputs = super()._inputs(op, partition, rows, step, chunk)
        if fault == "raise":
            raise RuntimeError(f"injected failure in {op.name} step {step} chunk {chunk}")
        return inputs
