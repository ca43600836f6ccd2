"""Column types: what flows along an edge of the graph.

A column is a named field of the step's table (rows = samples). Its type says the dtype, the
per-sample shape (fixed sizes as ints, ragged or variable sizes as names such as
``"response_len"``), whether it exists per sample or once for the whole batch, and whether it is
ordinary data, cross-step state (policy weights) or a metric.

    T.int64("response_len")          # ragged token ids, one row per sample
    T.float32()                      # one scalar per sample
    T.float32().per_batch()          # one value for the whole batch (e.g. a KL coefficient)
    T.opaque().state()               # cross-step state such as policy weights
    T.json().metric()                # metrics dict, kept even if nobody reads it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlgraph.errors import DeclarationError

__all__ = ["ColumnType", "T", "DTYPES", "ANY_DIM"]

DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int32",
    "int64",
    "bool",
    "str",  # one Python string per sample
    "json",  # one JSON-serialisable object per sample (or per batch)
    "opaque",  # state the data plane does not look into (weights handles)
)
ANY_DIM = "*"  # a consumer that accepts any size along this dimension

Level = Literal["sample", "batch"]
Kind = Literal["data", "state", "metric"]
Dim = int | str


@dataclass(frozen=True)
class ColumnType:
    """The type of a column: dtype, per-sample shape, level (sample/batch) and kind."""

    dtype: str
    shape: tuple[Dim, ...] = ()
    level: Level = "sample"
    kind: Kind = "data"
    doc: str = ""
    # state only: every rank of the producing group writes the same value (data-parallel replicas), so the
    # group's other ranks need no copy of rank 0's
    replicated: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise DeclarationError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, (int, str)):
                raise DeclarationError(
                    f"shape dimension {d!r} must be an int (fixed size) or a str (named ragged size)"
                )
            if isinstance(d, int) and d < 0:
                raise DeclarationError(f"shape dimension {d} must be >= 0")
        if self.level not in ("sample", "batch"):
            raise DeclarationError(f"level {self.level!r} must be 'sample' or 'batch'")
        if self.kind not in ("data", "state", "metric"):
            raise DeclarationError(f"kind {self.kind!r} must be 'data', 'state' or 'metric'")

    # Builders return new (immutable) types.
    def per_batch(self) -> ColumnType:
        """One value for the whole batch instead of one per sample."""
        return dataclasses.replace(self, level="batch")

    def state(self, replicated: bool = False) -> ColumnType:
        """Cross-step state: produced in step t, consumed in step t+1 (never a cycle). `replicated`: every
        rank of the producing group writes the same value (weights kept equal by DDP, DeepSpeed or FSDP2),
        so none of its ranks is given rank 0's copy."""
        return dataclasses.replace(self, kind="state", level="batch", replicated=replicated)

    def metric(self) -> ColumnType:
        """A batch-level metrics record: always kept, never pruned."""
        return dataclasses.replace(self, kind="metric", level="batch")

    def describe(self) -> str:
        """Short form such as ``int64[response_len]`` or ``float32[] @batch``."""
        dims = ",".join(str(d) for d in self.shape)
        s = f"{self.dtype}[{dims}]"
        if self.kind != "data":
            s += f" {self.kind}"
        elif self.level == "batch":
            s += " @batch"
        return s

    def is_ragged(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def compatible_with(self, consumer: ColumnType) -> str | None:
        """None if a consumer declaring `consumer` can read this column, else why not."""
        if self.dtype != consumer.dtype:
            return f"dtype {self.dtype} vs {consumer.dtype}"
        if len(self.shape) != len(consumer.shape):
            return f"shape {self.describe()} vs {consumer.describe()} (rank {len(self.shape)} vs {len(consumer.shape)})"
        for i, (a, b) in enumerate(zip(self.shape, consumer.shape)):
            if ANY_DIM in (a, b) or a == b:
                continue
            return f"dimension {i} is {a!r} in the producer but {b!r} in the consumer"
        if self.kind != consumer.kind:
            return f"kind {self.kind} vs {consumer.kind}"
        return None


class _TypeFactory:
    """Shorthands: ``T.float32("response_len")``, ``T.int64()``, ``T.str()``, ``T.json()``."""

    def __getattr__(self, dtype: str):
        if dtype.startswith("_"):
            raise AttributeError(dtype)
        if dtype not in DTYPES:
            raise AttributeError(f"T.{dtype}: unknown dtype; use one of {', '.join(DTYPES)}")

        def make(*shape: Dim, doc: str = "") -> ColumnType:
            return ColumnType(dtype=dtype, shape=tuple(shape), doc=doc)

        make.__name__ = dtype
        return make

    def __dir__(self):
        return list(DTYPES)


T = _TypeFactory()
