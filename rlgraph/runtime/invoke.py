"""Calling an op body on a chunk of rows: import it, assemble arguments, check what it returns.

The calling convention (docs/dsl.md):

- each input column arrives as one argument named like the column: fixed-shape numeric columns
  as a dense tensor ``[rows, *shape]``; ragged ones (a named dimension such as
  ``response_len``) right-padded with zeros to the longest row of the call, ``[rows, max_len]``
  (masks such as ``response_mask`` say which entries are real); ``str`` and ``json`` columns as
  lists; state columns as the value from the previous step (None at the first step);
- params arrive as keyword arguments; a parameter named ``ctx`` receives the `OpContext`;
- the op returns a dict with every declared output: per-sample columns with ``rows`` entries
  (a dense tensor, or a list of per-row tensors for ragged results); a dense ragged output is
  trimmed per row to the lengths of the input column with the same dimension name.

Nothing here depends on Ray, so it is unit-tested directly.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rlgraph.errors import RLGraphError
from rlgraph.graph.plan import ColumnPlan, OpPlan, Plan

__all__ = ["OpContext", "OpError", "stable_seed", "resolve_impl", "to_call_value", "check_outputs", "Invoker"]

TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from `parts` that is the same in every process (unlike `hash`)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class OpError(RLGraphError):
    """An op body failed or returned something that does not match its declaration."""


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
    # per named ragged dimension, each row's true length (inputs arrive right-padded with zeros)
    lengths: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"  # rank 0's address and a free port there: the group's
    master_port: int = 0  # torch.distributed rendezvous (DDP, DeepSpeed)
    outputs: tuple[str, ...] = ()  # the op's declared output columns, in declaration order
    # rows the op dropped in this call: index in the call -> (reason, whole group?); see `drop`
    dropped: dict[int, tuple[str, bool]] = field(default_factory=dict)

    def drop(self, index: int, reason: str, group: bool = False) -> None:
        """Drop row `index` of this call from training (with `group=True`, every sample of its
        group). The runtime counts it under ``samples/dropped/<reason>`` and treats it as padding
        in every op that depends on this one; the op still returns a value for the row."""
        if not 0 <= index < len(self.rows):
            raise IndexError(f"ctx.drop({index}): this call has {len(self.rows)} rows")
        if not reason or "/" in reason:
            raise ValueError(f"ctx.drop reason {reason!r} must be a non-empty name without '/'")
        self.dropped[index] = (reason, group)


def resolve_impl(ref: str, impl_file: str | None = None) -> tuple[Any, str | None]:
    """Import ``module:qualname``. Returns (object, class name) where the object is the function,
    or the class when the qualname is ``Class.method`` (the caller instantiates it once)."""
    module_name, sep, qualname = ref.partition(":")
    if not sep:
        raise OpError(f"op body reference {ref!r} is not of the form module:qualname")
    try:
        if module_name == "__main__" and impl_file:
            # a script's ops: import the script as a module (its `if __name__ == "__main__":`
            # block does not run), never the worker's own __main__
            raise ImportError("defined in a script")
        module = importlib.import_module(module_name)
    except ImportError as e:
        if not impl_file:
            raise OpError(f"cannot import {module_name!r} for op body {ref!r}: {e}") from e
        from rlgraph.graph.loader import import_file

        module = import_file(impl_file)
    parts = qualname.split(".")
    obj: Any = module
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            raise OpError(f"op body {ref!r}: {'.'.join(parts[:i]) or module_name!r} has no attribute {part!r}")
        if i == len(parts) - 1 and inspect.isclass(obj):
            return obj, part
        obj = getattr(obj, part)
    return obj, None


def to_call_value(col: ColumnPlan, values: Any) -> Any:
    """Turn a column's stored per-row values into the argument an op receives."""
    if col.dtype in ("str", "json", "opaque") or col.level == "batch":
        return list(values) if isinstance(values, tuple) else values
    if isinstance(values, torch.Tensor):
        return values
    rows = [torch.as_tensor(v) for v in values]
    if not rows:
        return torch.empty((0,), dtype=TORCH_DTYPES[col.dtype])
    if any(isinstance(d, str) for d in col.shape):
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0).to(TORCH_DTYPES[col.dtype])
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
            elif isinstance(values, (list, tuple)):
                try:
                    out[dim] = [int(torch.as_tensor(v).shape[axis]) for v in values]
                except (IndexError, TypeError):
                    pass
    return out


def check_outputs(plan: Plan, op: OpPlan, result: Any, n_rows: int,
                  lengths: Mapping[str, list[int]]) -> dict[str, Any]:
    """Validate an op's return value and convert per-sample outputs to per-row lists/tensors."""
    where = f"op {op.name!r}"
    if not isinstance(result, Mapping):
        raise OpError(f"{where} returned {type(result).__name__}; it must return a dict with columns "
                      f"{op.outputs}")
    missing = [c for c in op.outputs if c not in result]
    extra = [c for c in result if c not in op.outputs]
    if missing or extra:
        raise OpError(f"{where} returned columns {sorted(result)}, but declares {op.outputs}"
                      + (f"; missing {missing}" if missing else "") + (f"; undeclared {extra}" if extra else "")
                      + "; return exactly the declared outputs")
    out: dict[str, Any] = {}
    for name in op.outputs:
        col = plan.columns[name]
        value = result[name]
        if col.level == "batch" or col.kind != "data":
            out[name] = value
            continue
        size = len(value) if isinstance(value, (list, tuple)) else (
            value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None)
        if size != n_rows:
            raise OpError(f"{where}: output {name!r} has {size} rows for a call on {n_rows} rows; return one "
                          f"entry per row")
        if col.dtype in ("str", "json", "opaque"):
            out[name] = list(value)
            continue
        ragged = [(axis, d) for axis, d in enumerate(col.shape) if isinstance(d, str)]
        if isinstance(value, torch.Tensor) and ragged and ragged[0][1] in lengths:
            lens = lengths[ragged[0][1]]
            axis = ragged[0][0]
            value = [value[i].narrow(axis, 0, min(lens[i], value.shape[axis + 1])) for i in range(n_rows)]
        if isinstance(value, torch.Tensor):
            out[name] = value.to(TORCH_DTYPES[col.dtype])
        else:
            out[name] = [torch.as_tensor(v).to(TORCH_DTYPES[col.dtype]) for v in value]
    return out


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
        self.instances: dict[str, Any] = {}
        self.fns: dict[str, Callable] = {}
        self.state: dict[str, Any] = {}  # state columns produced or imported here
        self.last_dropped: dict[int, tuple[str, bool]] = {}  # rows the last call dropped (ctx.drop)
        for op in plan.ops:
            if op.group == group:
                self.fns[op.name] = self._bind(op)

    def _bind(self, op: OpPlan) -> Callable:
        if not op.impl:
            raise OpError(f"op {op.name!r} has no body (impl) in the plan; declare it with @op on a function "
                          f"or give OpSpec(impl='module:qualname')")
        obj, method = resolve_impl(op.impl, op.impl_file)
        if method is None:
            return obj
        key = f"{obj.__module__}:{obj.__qualname__}"
        if key not in self.instances:
            inst = obj()
            setup = getattr(inst, "setup", None)
            if callable(setup):
                setup(self._worker_context())
            self.instances[key] = inst
        return getattr(self.instances[key], method)

    def _worker_context(self) -> OpContext:
        return OpContext(op="", group=self.group, rank=self.rank, dp=self.dp, step=-1, chunk=-1,
                         seed=int(self.plan.config.get("trainer", {}).get("seed", 0)), rows=(),
                         is_padding=(), config=self.plan.config, master_addr=self.master_addr,
                         master_port=self.master_port)

    def call(self, op: OpPlan, step: int, chunk: int, rows: Sequence[int], is_padding: Sequence[bool],
             inputs: Mapping[str, Any], batch_inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run `op` on `rows` whose stored column values are `inputs`; returns checked outputs."""
        fn = self.fns[op.name]
        kwargs: dict[str, Any] = {name: to_call_value(self.plan.columns[name], inputs[name]) for name in op.inputs
                                  if name in inputs}
        if "is_padding" in kwargs:  # the call's tags, which include rows dropped upstream in this step
            kwargs["is_padding"] = torch.tensor([bool(p) for p in is_padding], dtype=torch.bool)
        for name, value in (batch_inputs or {}).items():
            kwargs[name] = value
        for name in op.state_inputs:
            kwargs[name] = self.state.get(name)
        kwargs.update(op.params)
        params = inspect.signature(fn).parameters
        lengths = _row_lengths(self.plan, op, inputs)
        self.last_dropped = {}
        ctx = None
        if "ctx" in params:
            seed = stable_seed(self.plan.config.get("trainer", {}).get("seed", 0), step, op.name, chunk)
            ctx = kwargs["ctx"] = OpContext(
                op=op.name, group=self.group, rank=self.rank, dp=self.dp, step=step, chunk=chunk, seed=seed,
                rows=tuple(rows), is_padding=tuple(is_padding), config=self.plan.config,
                master_addr=self.master_addr, master_port=self.master_port,
                lengths={k: tuple(v) for k, v in lengths.items()}, outputs=tuple(op.outputs))
        accepted = {k: v for k, v in kwargs.items() if k in params or _has_var_kw(params)}
        result = fn(**accepted)
        if ctx is not None:
            self.last_dropped = dict(ctx.dropped)
        out = check_outputs(self.plan, op, result, len(rows), lengths)
        for name in op.outputs:
            if self.plan.columns[name].kind == "state":
                self.state[name] = out[name]
        return out


def _has_var_kw(params: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in params.values())
