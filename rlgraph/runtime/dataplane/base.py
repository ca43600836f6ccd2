"""The data-plane interface: one step's table, written and read by workers, tracked per task.

A **partition** is one step's table: rows are samples ``0..num_rows-1``, columns are fields (an
edge of the graph). Workers ``put`` columns for some rows; the driver polls ``ready`` for rows
whose input columns all exist and that a task (an op) has not consumed yet, and hands the
returned `RowBatch` (row ids plus backend keys, never payload) to a worker, which ``get``\\ s
the columns itself. Payload moves worker to storage to worker; the driver only moves row ids.

Two backends implement the same semantics (`TransferQueueDataPlane`, `RayObjectStoreDataPlane`),
so TransferQueue stays swappable. Each backend has two sides:

- `DataPlane`, the driver side: ``create_partition``, ``clear``, ``close``, ``handle``;
- `DataPlaneClient`, the worker side (the driver object is one too): ``put``, ``ready``,
  ``get``. A worker gets one from ``plane.handle().connect()``; the handle is small and
  picklable, so it travels to Ray actors as an argument.

Column values, on the way in (``put``) and out (``get``):

- dense ``torch.Tensor`` ``[rows, *shape]``;
- ragged: a list of per-row tensors, or a ``torch.nested`` tensor (jagged or strided) on put;
  always a **list of per-row tensors** on get. `pad_ragged` densifies one;
- ``list[str]`` (or any list of picklable non-tensor objects, e.g. JSON values).

``get`` returns a dense tensor whenever every requested row has the same per-row shape and
dtype (so a ragged column whose rows happen to agree comes back dense), a list of tensors
otherwise, and a list for non-tensor columns. Both backends apply this one rule
(`assemble_rows`), which is what makes their results identical.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import torch

from rlgraph.errors import RLGraphError

__all__ = [
    "DataPlaneError",
    "RowBatch",
    "ColumnData",
    "DataPlaneClient",
    "DataPlane",
    "DataPlaneHandle",
    "pad_ragged",
    "assemble_rows",
    "payload_bytes_in_this_process",
]

ColumnData = Union[torch.Tensor, list]
"""A column for some rows: a dense tensor, a list of per-row tensors (ragged) or a list of
non-tensor values (strings, JSON objects)."""


class DataPlaneError(RLGraphError):
    """The data plane could not start, was misused (unknown rows, missing columns, bad values),
    or a wait on it timed out. The message names the partition, column or resource."""


@dataclass(frozen=True)
class RowBatch:
    """Rows of one partition: what ``ready`` returns and what ``get`` and ``put`` accept.

    Small and picklable (two tuples of ints), so the driver passes it to workers. ``keys`` are
    the backend's own ids for the rows, aligned with ``rows`` (TransferQueue's global indexes);
    they spare a lookup and may be empty, e.g. in ``RowBatch("step_3", (0, 1, 2))`` built by
    hand. ``columns`` are the columns ``ready`` was asked for: ``get``'s default.
    An empty batch is falsy: ``if not batch: poll again later``. Keys are valid until the
    partition is cleared; a batch kept across a clear and re-create must drop its keys.
    """

    partition: str
    rows: tuple[int, ...]
    keys: tuple[int, ...] = ()
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        object.__setattr__(self, "keys", tuple(int(k) for k in self.keys))
        object.__setattr__(self, "columns", tuple(self.columns))
        if self.keys and len(self.keys) != len(self.rows):
            raise DataPlaneError(
                f"RowBatch for partition {self.partition!r} has {len(self.rows)} rows but "
                f"{len(self.keys)} keys; pass one key per row or none"
            )

    def __len__(self) -> int:
        return len(self.rows)


# --------------------------------------------------------------------------- byte counter
# Payload bytes that went through put/get in *this process*, whatever plane or client did it.
# The driver reads it to check that payload does not pass through it (it should stay ~0).
_bytes_lock = threading.Lock()
_process_bytes = 0


def _count_bytes(n: int) -> None:
    global _process_bytes
    with _bytes_lock:
        _process_bytes += n


def payload_bytes_in_this_process() -> int:
    """Column payload bytes passed to ``put`` or returned by ``get`` in this process so far."""
    return _process_bytes


def _nbytes(value: ColumnData) -> int:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return sum(t.numel() * t.element_size() for t in value.unbind())
        return value.numel() * value.element_size()
    total = 0
    for v in value:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, str):
            total += len(v.encode())
        elif isinstance(v, bytes):
            total += len(v)
    return total


# --------------------------------------------------------------------------- columns
@dataclass(frozen=True)
class _Column:
    """A column checked and normalised for ``put``: kind is dense, ragged or objects."""

    kind: str
    value: Any  # dense: Tensor [n, ...]; ragged: list[Tensor]; objects: list


def _normalize(name: str, value: Any, n_rows: int) -> _Column:
    """Check one column of a put and bring it to one of three forms. Ragged lists whose rows
    all have the same shape and dtype are stacked: they are dense."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            value = list(value.unbind())
        else:
            if value.dim() == 0 or value.shape[0] != n_rows:
                got = "a 0-d tensor" if value.dim() == 0 else f"{value.shape[0]} rows"
                raise DataPlaneError(
                    f"column {name!r}: put for {n_rows} rows got {got}; "
                    f"pass a tensor [rows, ...] with one entry per row"
                )
            return _Column("dense", value.contiguous())
    if not isinstance(value, (list, tuple)):
        raise DataPlaneError(
            f"column {name!r}: unsupported type {type(value).__name__}; pass a tensor [rows, ...], "
            f"a list of per-row tensors (ragged) or a list of strings/objects"
        )
    if len(value) != n_rows:
        raise DataPlaneError(f"column {name!r}: put for {n_rows} rows got a list of {len(value)}")
    tensors = [isinstance(v, torch.Tensor) for v in value]
    if any(tensors) and not all(tensors):
        raise DataPlaneError(f"column {name!r}: mixes tensors and non-tensors; use one kind per column")
    if not value or not tensors[0]:
        return _Column("objects", list(value))
    dtypes = {v.dtype for v in value}
    if len(dtypes) > 1:
        raise DataPlaneError(f"column {name!r}: rows have different dtypes {sorted(map(str, dtypes))}")
    if len({v.dim() for v in value}) > 1:
        raise DataPlaneError(f"column {name!r}: rows have different numbers of dimensions")
    if len({tuple(v.shape) for v in value}) == 1:
        return _Column("dense", torch.stack(value))
    return _Column("ragged", [v.contiguous() for v in value])


def assemble_rows(values: Sequence[Any]) -> ColumnData:
    """Per-row values of one column -> what ``get`` returns (the one rule both backends share):
    a dense tensor if every value is a tensor of one shape and dtype, else a list."""
    values = list(values)
    if values and all(isinstance(v, torch.Tensor) for v in values):
        first = values[0]
        if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.stack(values)
    return values


def pad_ragged(values: ColumnData, pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-row tensors along their first dimension: ``(padded, lengths)``.

    ``padded`` is ``[rows, max_len, *rest]`` and ``lengths`` is ``[rows]`` int64. A dense
    tensor ``[rows, len, ...]`` (what ``get`` returns when all rows agree) is returned as is,
    with every length equal to ``len``.
    """
    if isinstance(values, torch.Tensor) and not values.is_nested:
        if values.dim() < 2:
            raise DataPlaneError(f"pad_ragged needs rows with a length dimension, got shape {tuple(values.shape)}")
        return values, torch.full((values.shape[0],), values.shape[1], dtype=torch.int64)
    rows = list(values.unbind()) if isinstance(values, torch.Tensor) else list(values)
    if not rows:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64)
    if any(not isinstance(r, torch.Tensor) or r.dim() == 0 for r in rows):
        raise DataPlaneError("pad_ragged needs per-row tensors with at least one dimension")
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)
    return padded, lengths


def _check_rows(partition: str, rows: Sequence[int]) -> tuple[int, ...]:
    rows = tuple(int(r) for r in rows)
    if len(set(rows)) != len(rows):
        raise DataPlaneError(f"partition {partition!r}: rows {list(rows)} contain duplicates")
    if any(r < 0 for r in rows):
        raise DataPlaneError(f"partition {partition!r}: row ids must be >= 0, got {min(rows)}")
    return rows


# --------------------------------------------------------------------------- interfaces
class DataPlaneClient(ABC):
    """The worker side: write columns, poll for ready rows, read columns.

    The public methods check arguments, normalise columns and count payload bytes, then call
    the backend's ``_put``/``_ready``/``_get``; subclasses implement only those.
    """

    def put(
        self, partition: str, rows: Sequence[int] | RowBatch, columns: Mapping[str, ColumnData]
    ) -> None:
        """Write ``columns`` for ``rows`` of ``partition`` (each column has one entry per row,
        in the order of ``rows``). ``rows`` may be a `RowBatch` of that partition, whose keys
        then spare a lookup. Rewriting a column of a row replaces it; consumption is kept."""
        if isinstance(rows, RowBatch):
            if rows.partition != partition:
                raise DataPlaneError(f"put to partition {partition!r} got a RowBatch of {rows.partition!r}")
            batch = rows
        else:
            batch = RowBatch(partition, _check_rows(partition, rows))
        if not columns:
            raise DataPlaneError(f"put to partition {partition!r} got no columns")
        if not batch.rows:
            return
        norm = {name: _normalize(name, value, len(batch)) for name, value in columns.items()}
        self._put(batch, norm)
        _count_bytes(sum(_nbytes(c.value) for c in norm.values()))

    def ready(self, partition: str, columns: Sequence[str], task: str, max_rows: int) -> RowBatch:
        """Up to ``max_rows`` rows (lowest row ids first) whose ``columns`` all exist and that
        ``task`` has not consumed yet, now marked consumed by ``task``. Never blocks: returns an
        empty batch when no row qualifies (also for a partition that does not exist yet).
        Each task sees every row once; different tasks consume independently."""
        columns = tuple(columns)
        if not columns:
            raise DataPlaneError(f"ready on partition {partition!r} for task {task!r} needs at least one column")
        if not task:
            raise DataPlaneError(f"ready on partition {partition!r} needs a non-empty task name")
        if max_rows < 1:
            raise DataPlaneError(f"ready on partition {partition!r}: max_rows must be >= 1, got {max_rows}")
        return self._ready(partition, columns, task, int(max_rows))

    def get(self, batch: RowBatch, columns: Sequence[str] | None = None) -> dict[str, ColumnData]:
        """Read ``columns`` (default: those ``batch`` was made ready for) of ``batch``'s rows, in
        row order of the batch. Raises `DataPlaneError` if a requested cell was never written.
        Does not change consumption."""
        cols = tuple(columns) if columns is not None else batch.columns
        if not cols:
            raise DataPlaneError(f"get on partition {batch.partition!r} needs columns (the batch names none)")
        _check_rows(batch.partition, batch.rows)
        if not batch.rows:
            return {c: [] for c in cols}
        out = self._get(batch, cols)
        _count_bytes(sum(_nbytes(v) for v in out.values()))
        return out

    def close(self) -> None:  # noqa: B027 - a client without connections has nothing to do
        """Release this client's connections (sockets, threads). The data stays."""

    @abstractmethod
    def _put(self, batch: RowBatch, columns: dict[str, _Column]) -> None: ...

    @abstractmethod
    def _ready(self, partition: str, columns: tuple[str, ...], task: str, max_rows: int) -> RowBatch: ...

    @abstractmethod
    def _get(self, batch: RowBatch, columns: tuple[str, ...]) -> dict[str, ColumnData]: ...


class DataPlaneHandle(ABC):
    """A small picklable description of a running plane; ``connect()`` inside a Ray actor (or
    any process attached to the same Ray cluster) returns a `DataPlaneClient`."""

    @abstractmethod
    def connect(self) -> DataPlaneClient: ...


class DataPlane(DataPlaneClient):
    """The driver side: owns the backend's processes, creates and clears partitions.

    Use as a context manager, or call ``close()``: it stops only what this object started.
    """

    @abstractmethod
    def create_partition(self, partition: str, num_rows: int) -> None:
        """Register ``partition`` with rows ``0..num_rows-1``. Puts to other rows fail.
        Raises if the partition already exists (``clear`` it first)."""

    @abstractmethod
    def clear(self, partition: str) -> None:
        """Drop ``partition``: its rows, payload and consumption. Unknown partitions are a no-op."""

    @abstractmethod
    def handle(self) -> DataPlaneHandle:
        """What a worker needs to connect: pass it to actors, call ``connect()`` there."""

    def payload_bytes_in_this_process(self) -> int:
        """Column payload bytes that went through put/get in this (the driver's) process.
        Stays ~0 when workers put and get themselves and the driver only passes `RowBatch`es."""
        return payload_bytes_in_this_process()

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
