"""Calling an op body on a chunk of rows: bind it, assemble arguments, check what it returns.

The calling convention (docs/dsl.md):

- each input column arrives as one argument named like the column: fixed-shape numeric columns
  as a dense tensor ``[rows, *shape]``; ragged ones (a named dimension such as
  ``response_len``) right-padded with zeros to the longest row of the call, ``[rows, max_len]``
  (masks such as ``response_mask`` say which entries are real), or, for those the op names in
  ``as_rows``, as their rows (`rlgraph.rows.Rows`, read-only: a body that changes them in place
  fails its call); ``str`` and ``json`` columns as lists; state columns as the value from the
  previous step (None at the first step);
- params arrive as keyword arguments, except those the runtime consumes itself (batching sizes,
  the group size, setup-time params: ``OpPlan.runtime_params``), which the body receives only if
  it names them; a parameter named ``ctx`` receives the `OpContext`, whose ``batching`` and
  ``group_size`` come from the plan;
- the op returns a dict with every declared output: per-sample columns with ``rows`` entries
  (a dense tensor, or a list of per-row tensors for ragged results); a dense ragged output is
  trimmed per row to the lengths of the input column with the same dimension name.

A body is bound to its declaration when the worker starts: a body that does not accept a
declared input or param, or requires an argument nobody declares, fails the run at start-up
with a `BindingError` naming both. Nothing here depends on Ray, so it is unit-tested directly.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from rlgraph.errors import OpError
from rlgraph.graph.loader import resolve_impl
from rlgraph.graph.plan import ColumnPlan, OpBatching, OpPlan, Plan
from rlgraph.graph.settings import TrainerSettings
from rlgraph.rows import READS_FLAT, Rows, pad_rows, rows_of, tensors, trimmed_rows
from rlgraph.seeds import stable_seed

log = logging.getLogger("rlgraph.runtime")

__all__ = ["OpContext", "OpError", "BindingError", "binding_problems", "to_call_value",
           "check_outputs", "Invoker", "TORCH_DTYPES"]

TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}
_CTX = "ctx"


class BindingError(OpError):
    """An op body's signature does not match the op's declaration (columns and params)."""


@dataclass(frozen=True)
class OpContext:
    """What an op body may want to know about the call besides its columns."""

    op: str
    group: str
    rank: int
    dp: int
    step: int
    chunk: int
    seed: int  # derived from (trainer.seed, step, op, chunk): same under every schedule
    rows: tuple[int, ...]
    is_padding: tuple[bool, ...]
    config: Mapping[str, Any] = field(default_factory=dict)  # the whole resolved config, nested
    # per named ragged dimension, each row's true length (inputs arrive right-padded with zeros, but for
    # those the op takes as_rows)
    lengths: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"  # rank 0's address and a free port there: the group's
    master_port: int = 0  # torch.distributed rendezvous (DDP, DeepSpeed)
    outputs: tuple[str, ...] = ()  # the op's declared output columns, in declaration order
    group_size: int = 1  # n: samples per prompt (the plan's batch.n)
    batching: OpBatching | None = None  # how the plan splits this op's work (mini/micro-batches, epochs)
    can_drop: bool = False  # the op is declared with drops=True
    wanted: tuple[str, ...] = ()  # outputs some op reads or the pipeline keeps; others are dropped (skip computing them)
    # rows the op dropped in this call: index in the call -> (reason, whole group?); see `drop`
    dropped: dict[int, tuple[str, bool]] = field(default_factory=dict)
    # the state columns this worker holds now (live: a value imported while the call runs shows here;
    # partial rollout reads newer weights from it mid-call). The call's own inputs are its arguments
    state: Mapping[str, Any] = field(default_factory=dict)
    # timed events inside the call for the timeline: (start, end, lane, label), e.g. an agent's turns
    events: list[tuple[float, float, int, str]] = field(default_factory=list)
    # 'module:qualname' of every op body this worker's group runs (a worker class's setup may depend on
    # whether, e.g., the group trains the model it loads)
    group_impls: tuple[str, ...] = ()
    # the op's state outputs the runtime gives to other workers (another group, or the other ranks of this
    # one); a state output not named here is read only where it was written
    exported: frozenset[str] = frozenset()
    # the sizes of the chunks this call holds, rows in order: one chunk, unless the op is vectorised
    # (then a metric output may be a list with one record per chunk)
    chunks: tuple[int, ...] = ()

    def __getattr__(self, name: str) -> Any:
        """``seed`` of a context the runtime made (`Invoker._context`): hashed when first read, not for
        every call (most ops never read it; 20 us of a small op's call with the caches cold)."""
        if name == "seed":
            parts = self.__dict__.get("_seed_parts")
            if parts is not None:
                seed = stable_seed(*parts)
                object.__setattr__(self, "seed", seed)
                return seed
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def event(self, start: float, end: float, lane: int, label: str) -> None:
        """Record something that happened inside this call (times from `time.time()`): the timeline
        draws it on lane `lane` of the call's box (e.g. an agent trajectory's turns and tool calls)."""
        self.events.append((float(start), float(end), int(lane), str(label)))

    def drop(self, index: int, reason: str, group: bool = False) -> None:
        """Drop row `index` of this call from training (with `group=True`, every sample of its
        group). The runtime counts it under ``samples/dropped/<reason>`` and treats it as padding
        in every op that depends on this one; the op still returns a value for the row. Only an
        op declared with ``drops=True`` may drop rows."""
        if not self.can_drop:
            raise OpError(f"op {self.op!r} called ctx.drop but is not planned to drop rows; declare it with "
                          f"drops=True (@op(..., drops=True) or OpSpec(drops=True)), and where its OpSpec has a "
                          f"drops_if, make it true for the params that drop, so that the plan lists the ops its "
                          f"drops reach")
        if not 0 <= index < len(self.rows):
            raise IndexError(f"ctx.drop({index}): this call has {len(self.rows)} rows")
        if not reason or "/" in reason:
            raise ValueError(f"ctx.drop reason {reason!r} must be a non-empty name without '/'")
        self.dropped[index] = (reason, group)


def binding_problems(fn: Callable, columns: Iterable[str], params: Iterable[str],
                     runtime_params: Iterable[str] = ()) -> list[str]:
    """Why `fn` cannot be called with the declared `columns` and `params` ([] if it can).

    Every column and every param outside `runtime_params` is passed by name, so the body must
    accept each (or take ``**kwargs``); a body parameter without a default that is neither
    declared nor ``ctx`` would never be given a value."""
    sig = inspect.signature(fn).parameters
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.values())
    columns, params, runtime = list(columns), list(params), set(runtime_params)
    problems = []
    if not var_kw:
        cols = [c for c in columns if c not in sig]
        prms = [k for k in params if k not in sig and k not in runtime]
        if cols:
            problems.append(f"does not accept declared input column(s) {cols}")
        if prms:
            problems.append(f"does not accept declared param(s) {prms}")
    declared = set(columns) | set(params) | {_CTX}
    required = [n for n, p in sig.items() if n not in declared and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        problems.append(f"requires argument(s) {required}, which the op declares neither as input columns nor as "
                        f"params")
    return problems


def to_call_value(col: ColumnPlan, values: Any, as_rows: bool = False, uncut: bool = False) -> Any:
    """Turn a column's stored per-row values into the argument an op receives (`as_rows`: a ragged
    column of one dimension as its rows, `rlgraph.rows.Rows`, which the body reads without a copy; cut
    into its row views unless `uncut`: a body marked `rlgraph.rows.reads_flat` reads only their flat
    tensor and lengths)."""
    if col.dtype in ("str", "json", "opaque") or col.level == "batch":
        return list(values) if isinstance(values, tuple) else values
    if as_rows:
        rows = rows_of(values, TORCH_DTYPES[col.dtype])
        return rows if uncut else rows.cut()
    if isinstance(values, torch.Tensor):
        return values
    ragged = any(isinstance(d, str) for d in col.shape)
    if ragged and type(values) is Rows and values.flat is not None and values:
        padded, dtype = values.padded(), TORCH_DTYPES[col.dtype]  # padded once for all its readers
        return padded.clone() if padded.dtype is dtype else padded.to(dtype)  # the body may change its copy
    rows = tensors(values)
    if not rows:
        return torch.empty((0,), dtype=TORCH_DTYPES[col.dtype])
    if ragged:
        padded = pad_rows(rows)
        if padded is None:
            padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        return padded.to(TORCH_DTYPES[col.dtype])
    return torch.stack(rows).to(TORCH_DTYPES[col.dtype])


def _row_lengths(plan: Plan, op: OpPlan, stored_inputs: Mapping[str, Any]) -> dict[str, list[int]]:
    """Per dimension name, each row's length, from the ragged inputs of this call."""
    out: dict[str, list[int]] = {}
    for name, values in stored_inputs.items():
        col = plan.columns[name]
        if col.level != "sample" or col.dtype in ("str", "json", "opaque"):
            continue
        for axis, dim in enumerate(col.shape):
            if not isinstance(dim, str) or dim in out or dim == "*":
                continue
            if isinstance(values, torch.Tensor):  # every row had the same length: the data plane sent it dense
                out[dim] = [int(values.shape[axis + 1])] * int(values.shape[0])
            elif type(values) is Rows and values.flat is not None:  # 1-D rows: their lengths are known
                if axis == 0:
                    out[dim] = list(values.lengths)
            elif isinstance(values, (list, tuple)):
                try:
                    try:  # tensors (arrays): their shapes as they are
                        out[dim] = [v.shape[axis] for v in values]
                    except AttributeError:  # lists of numbers
                        out[dim] = [int((v if isinstance(v, torch.Tensor) else torch.as_tensor(v)).shape[axis])
                                    for v in values]
                except (IndexError, TypeError):
                    pass
    return out


def _per_row(col: ColumnPlan) -> bool:
    """A per-sample data column: one entry per row of a call (what a streaming body yields in parts)."""
    return col.level == "sample" and col.kind == "data"


def _convert(plan: Plan, op: OpPlan, name: str, value: Any, n_rows: int, lengths: Mapping[str, Sequence[int]]) -> Any:
    """One output as the runtime stores it: per-sample columns checked for one entry per row and
    brought to per-row tensors (dense ragged values trimmed to the rows' lengths)."""
    col = plan.columns[name]
    if not _per_row(col):
        return value
    size = len(value) if isinstance(value, (list, tuple)) else (
        value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None)
    if size != n_rows:
        raise OpError(f"op {op.name!r}: output {name!r} has {size} rows for a call on {n_rows} rows; return one "
                      f"entry per row")
    if col.dtype in ("str", "json", "opaque"):
        return list(value)
    dtype = TORCH_DTYPES[col.dtype]
    ragged = [(axis, d) for axis, d in enumerate(col.shape) if isinstance(d, str)]
    if isinstance(value, torch.Tensor) and ragged and ragged[0][1] in lengths:
        lens = lengths[ragged[0][1]]
        axis = ragged[0][0]
        value = value.to(dtype)  # once for the call, not once per row
        width = value.shape[axis + 1]
        if len(lens) == value.shape[0] and min(lens, default=width) >= width:  # every row is whole: stays dense
            return value
        if len(lens) != value.shape[0]:
            raise OpError(f"op {op.name!r}: output {name!r} has {value.shape[0]} rows, but the call's inputs give "
                          f"{len(lens)} row lengths for {ragged[0][1]!r}")
        if value.dim() == 2:  # token rows: the real tokens in one masked copy, cut into rows (no narrow per row)
            return trimmed_rows(value, [n if n < width else width for n in lens])
        return [row.narrow(axis, 0, min(n, width)) for row, n in zip(value.unbind(0), lens)]
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if type(value) is Rows and value.flat is not None and value.flat.dtype is dtype:  # as they are, padding kept
        if ragged and col.shape == [ragged[0][1]] and ragged[0][1] in lengths \
                and value.lengths != list(lengths[ragged[0][1]]):
            raise OpError(f"op {op.name!r}: output {name!r} has rows of lengths {_shown_lengths(value.lengths)}, but the "
                          f"call's rows are {_shown_lengths(lengths[ragged[0][1]])} long in {ragged[0][1]!r}; give "
                          f"each row its row's length")
        return value
    if all(type(v) is torch.Tensor and v.dtype is dtype for v in value):  # as they are (what the line below gives)
        return list(value)
    return [torch.as_tensor(v).to(dtype) for v in value]


def _shown_lengths(lengths: Sequence[int]) -> str:
    shown = list(lengths[:8])
    return f"{shown}{' ...' if len(lengths) > 8 else ''}"


def _check_columns(op: OpPlan, result: Any, expected: Sequence[str], what: str) -> None:
    """`result` (what the body `what`: returned, yielded) holds exactly the columns `expected`."""
    if not isinstance(result, Mapping):
        raise OpError(f"op {op.name!r} {what} {type(result).__name__}; it must give a dict with columns "
                      f"{list(expected)}")
    missing = [c for c in expected if c not in result]
    extra = [c for c in result if c not in expected]
    if missing or extra:
        raise OpError(f"op {op.name!r} {what} columns {sorted(result)}, but declares {list(expected)}"
                      + (f"; missing {missing}" if missing else "") + (f"; undeclared {extra}" if extra else "")
                      + "; return exactly the declared outputs")


def check_outputs(plan: Plan, op: OpPlan, result: Any, n_rows: int,
                  lengths: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """Validate an op's return value and convert per-sample outputs to per-row lists/tensors."""
    _check_columns(op, result, op.outputs, "returned")
    return {name: _convert(plan, op, name, result[name], n_rows, lengths) for name in op.outputs}


@dataclass(frozen=True)
class _Bound:
    """An op's body with what it is passed: every input, the params outside runtime_params, and the
    runtime params it names; ``ctx`` if it names it."""

    fn: Callable
    params: Mapping[str, Any]
    takes_ctx: bool
    reads_flat: bool = False  # its as_rows inputs may come uncut (`rlgraph.rows.reads_flat`)


class Invoker:
    """Holds an actor's op bodies (instantiating each worker class once) and calls them."""

    def __init__(self, plan: Plan, group: str, rank: int, dp: int, master_addr: str = "127.0.0.1",
                 master_port: int = 0) -> None:
        self.plan = plan
        self.group = group
        self.rank = rank
        self.dp = dp
        self.master_addr = master_addr
        self.master_port = master_port
        self.seed = TrainerSettings.of(plan).seed
        self.instances: dict[str, Any] = {}
        self.bound: dict[str, _Bound] = {}
        self.state: dict[str, Any] = {}  # state columns produced or imported here
        self.last_dropped: dict[int, tuple[str, bool]] = {}  # rows the last call dropped (ctx.drop)
        self.last_events: list[tuple[float, float, int, str]] = []  # the last call's timed events (ctx.event)
        self.last_rest: dict[str, Any] = {}  # a streaming call's outputs other than its per-sample ones
        self._fixed: dict[str, dict[str, Any]] = {}  # per op, the `OpContext` fields the same in each call
        for op in plan.ops:
            if op.group == group:
                self.bound[op.name] = self._bind(op)

    def _bind(self, op: OpPlan) -> _Bound:
        if not op.impl:
            raise OpError(f"op {op.name!r} has no body (impl) in the plan; declare it with @op on a function "
                          f"or give OpSpec(impl='module:qualname')")
        obj, method = resolve_impl(op.impl, op.impl_file)
        fn = obj
        if method is not None:
            key = f"{obj.__module__}:{obj.__qualname__}"
            if key not in self.instances:
                inst = obj()
                setup = getattr(inst, "setup", None)
                if callable(setup):
                    setup(self._worker_context())
                self.instances[key] = inst
            fn = getattr(self.instances[key], method)
        problems = binding_problems(fn, [*op.inputs, *op.state_inputs], op.params, op.runtime_params)
        if op.streams != inspect.isgeneratorfunction(fn):
            problems.append("is a generator function (it streams its rows in parts), but the op is not declared "
                            "streams=True" if not op.streams else "is declared streams=True but is not a generator "
                            "function (a streaming body yields (rows, outputs) parts)")
        if problems:
            raise BindingError(
                f"op {op.name!r}: its body {op.impl} " + "; ".join(problems) + ". Make the body's signature match "
                f"the declaration: one parameter per input column, keyword-only parameters for params (params the "
                f"runtime consumes, {op.runtime_params}, may be left out), or change the declaration")
        sig = inspect.signature(fn).parameters
        var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.values())
        params = {k: v for k, v in op.params.items() if k not in op.runtime_params or k in sig or var_kw}
        return _Bound(fn, params, _CTX in sig, bool(getattr(fn, READS_FLAT, False)))

    def close(self) -> None:
        """Close every worker-class instance that has a ``close`` (a vLLM engine's processes and shared
        memory, a reward's process pool, a judge's connections, an agent's environments), the last made
        first. One that fails is logged and the others are closed still."""
        for key, inst in reversed(list(self.instances.items())):
            close = getattr(inst, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as e:  # the process ends next: say so, and close the rest
                log.warning("closing %s (group %s, rank %d) failed: %s: %s", key, self.group, self.rank,
                            type(e).__name__, e)
        self.instances.clear()

    def _worker_context(self) -> OpContext:
        return OpContext(op="", group=self.group, rank=self.rank, dp=self.dp, step=-1, chunk=-1,
                         seed=self.seed, rows=(), is_padding=(), config=self.plan.config,
                         master_addr=self.master_addr, master_port=self.master_port, group_size=self.plan.batch.n,
                         group_impls=tuple(self.plan.op(n).impl or "" for n in self.plan.group(self.group).ops))

    def _start(self, op: OpPlan, step: int, chunk: int, rows: Sequence[int], is_padding: Sequence[bool],
               inputs: Mapping[str, Any], batch_inputs: Mapping[str, Any] | None,
               salt: int = 0, chunks: tuple[int, ...] = ()
               ) -> tuple[Any, dict, OpContext | None, list[tuple[str, torch.Tensor, int]]]:
        """Call the body: its return value (a generator for a streaming body), the rows' lengths, its ctx,
        and the inputs it was given as rows (column, flat tensor, its version then: `_check_given_rows`)."""
        bound = self.bound[op.name]
        kwargs: dict[str, Any] = {name: to_call_value(self.plan.columns[name], inputs[name], name in op.as_rows,
                                                      bound.reads_flat)
                                  for name in op.inputs if name in inputs}
        given = [(name, kwargs[name].flat, kwargs[name].flat._version) for name in op.as_rows if name in kwargs]
        if "is_padding" in kwargs:  # the call's tags, which include rows dropped upstream in this step
            kwargs["is_padding"] = torch.tensor([bool(p) for p in is_padding], dtype=torch.bool)
        kwargs.update(batch_inputs or {})
        for name in op.state_inputs:
            kwargs[name] = self.state.get(name)
        kwargs.update(bound.params)
        lengths = _row_lengths(self.plan, op, inputs)
        self.last_dropped, self.last_events = {}, []
        ctx = None
        if bound.takes_ctx:
            ctx = kwargs[_CTX] = self._context(
                op, step=step, chunk=chunk, _seed_parts=(self.seed, step, op.name, chunk, *((salt,) if salt else ())),
                rows=tuple(rows), is_padding=tuple(is_padding), lengths={k: tuple(v) for k, v in lengths.items()},
                chunks=chunks or (len(rows),), dropped={}, events=[])
        return bound.fn(**kwargs), lengths, ctx, given

    def _context(self, op: OpPlan, **call: Any) -> OpContext:
        """`op`'s `OpContext` for one call: the fields that are the same in each of its calls made once (the
        plan does not change under a worker), the call's own set on a new instance. Every field is given (the
        seed as the parts it is hashed from, when first read: `OpContext.__getattr__`), so this is what
        ``OpContext(...)`` would make, without the frozen dataclass's ``__init__`` (24 fields one by one: 42 us
        of a small op's call with the caches cold, as they are after a model's pass)."""
        fixed = self._fixed.get(op.name)
        if fixed is None:
            fixed = self._fixed[op.name] = dict(
                op=op.name, group=self.group, rank=self.rank, dp=self.dp, config=self.plan.config,
                master_addr=self.master_addr, master_port=self.master_port, outputs=tuple(op.outputs),
                group_size=self.plan.batch.n, batching=op.batching, can_drop=op.drops,
                wanted=tuple(c for c in op.outputs if self.plan.columns[c].stored), state=self.state,
                group_impls=(), exported=self._exported(op))
        ctx = object.__new__(OpContext)
        fields = ctx.__dict__
        fields.update(fixed)
        fields.update(call)
        return ctx

    @staticmethod
    def _check_given_rows(op: OpPlan, given: list[tuple[str, torch.Tensor, int]]) -> None:
        """The call's inputs given as rows are as they were given: they are the runtime's own tensors (other
        ops read them too), so a body that changed one in place fails its call rather than their results.
        In-place changes through torch to a tensor or any view of it count in its version counter (a
        write through ``.numpy()`` or ``.data`` does not: none is told)."""
        changed = [name for name, flat, version in given if flat._version != version]
        if changed:
            raise OpError(f"op {op.name!r} changed its input(s) {changed} in place; an input the op takes as_rows is "
                          f"the runtime's own tensor, which other ops read too: read it, and change a copy "
                          f"(rows.flat.clone(), or row.clone()), or leave the column out of as_rows to get a padded copy")

    def _exported(self, op: OpPlan) -> frozenset[str]:
        """`op`'s state outputs that cross to other workers (as `rlgraph.runtime.window.Window.moves` decides)."""
        out = set()
        for name in op.outputs:
            col = self.plan.columns[name]
            if col.kind != "state":
                continue
            groups = {self.plan.op(c).group for c in col.consumers}
            if groups - {op.group} or (op.group in groups and self.dp > 1 and not col.replicated):
                out.add(name)
        return frozenset(out)

    def _keep_state(self, op: OpPlan, out: Mapping[str, Any]) -> None:
        for name in op.outputs:
            if self.plan.columns[name].kind == "state":
                self.state[name] = out[name]

    def call(self, op: OpPlan, step: int, chunk: int, rows: Sequence[int], is_padding: Sequence[bool],
             inputs: Mapping[str, Any], batch_inputs: Mapping[str, Any] | None = None, salt: int = 0,
             chunks: tuple[int, ...] = ()) -> dict[str, Any]:
        """Run `op` on `rows` whose stored column values are `inputs`; returns checked outputs. `salt`
        (a refill round) enters the call's seed; `chunks`: a vectorised op's chunk sizes (`OpContext.chunks`)."""
        result, lengths, ctx, given = self._start(op, step, chunk, rows, is_padding, inputs, batch_inputs, salt,
                                                  chunks)
        self._check_given_rows(op, given)
        if ctx is not None:
            self.last_dropped = dict(ctx.dropped)
            self.last_events = list(ctx.events)
        out = check_outputs(self.plan, op, result, len(rows), lengths)
        self._keep_state(op, out)
        return out

    def stream(self, op: OpPlan, step: int, chunk: int, rows: Sequence[int], is_padding: Sequence[bool],
               inputs: Mapping[str, Any], batch_inputs: Mapping[str, Any] | None = None, salt: int = 0
               ) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """Run a streaming `op` on `rows`: yields ``(positions, outputs)`` for each part the body
        yields (positions in the call, its per-sample outputs for them, checked and converted). Once
        it is exhausted, `last_rest` holds the op's other outputs (metrics, state, batch columns) and
        `last_dropped` the rows it dropped. Every row must be yielded exactly once."""
        parts, lengths, ctx, given = self._start(op, step, chunk, rows, is_padding, inputs, batch_inputs, salt)
        per_row = [c for c in op.outputs if _per_row(self.plan.columns[c])]
        rest = [c for c in op.outputs if c not in per_row]
        done = [False] * len(rows)
        self.last_rest = {}
        while True:
            try:
                item = next(parts)
            except StopIteration as stop:
                tail = stop.value if stop.value is not None else {}
                break
            if not (isinstance(item, tuple) and len(item) == 2):
                raise OpError(f"op {op.name!r} yielded {type(item).__name__}; a streaming body yields (rows, outputs): "
                              f"the positions of some of its call's rows and their per-sample outputs")
            positions, outputs = [int(p) for p in item[0]], item[1]
            bad = [p for p in positions if not 0 <= p < len(rows) or done[p]]
            if bad or len(set(positions)) != len(positions):
                raise OpError(f"op {op.name!r} yielded rows {bad or positions}, which are not in the call's {len(rows)} "
                              f"rows or were yielded before; yield each row of the call once")
            _check_columns(op, outputs, per_row, "yielded")
            part_lengths = {k: [v[p] for p in positions] for k, v in lengths.items()}
            for p in positions:
                done[p] = True
            yield positions, {c: _convert(self.plan, op, c, outputs[c], len(positions), part_lengths)
                              for c in per_row}
        self._check_given_rows(op, given)
        missing = [i for i, d in enumerate(done) if not d]
        if missing:
            raise OpError(f"op {op.name!r} ended without yielding rows {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                          f"of its call; yield every row once")
        _check_columns(op, tail, rest, "returned (after its last part)")
        self.last_rest = dict(tail)
        self._keep_state(op, self.last_rest)
        if ctx is not None:
            self.last_dropped = dict(ctx.dropped)
            self.last_events = list(ctx.events)
