"""The data-plane interface: one table per step, written and read by workers.

A **partition** is one step's table: rows are samples ``0..num_rows-1``, columns are fields (an
edge of the graph). Workers ``put`` columns for some rows and ``get`` the columns they read;
the driver creates and clears partitions and passes only row ids. Which rows are ready for
which op is the scheduler's business (`rlgraph.runtime.scheduler`, from call results), not the
data plane's: the plane stores and serves cells, nothing more.

Two backends implement the same semantics (`TransferQueueDataPlane`, `RayObjectStoreDataPlane`),
so TransferQueue stays swappable. Each backend has two sides:

- `DataPlane`, the driver side: ``create_partition``, ``clear``, ``close``, ``handle``;
- `DataPlaneClient`, the worker side (the driver object is one too): ``put`` and ``get``. A
  worker gets one from ``plane.handle().connect()``; the handle is small and picklable, so it
  travels to Ray actors as an argument.

Column values, on the way in (``put``) and out (``get``):

- dense ``torch.Tensor`` ``[rows, *shape]``;
- ragged: a list of per-row tensors, or a ``torch.nested`` tensor (jagged or strided) on put;
  a **list of per-row tensors** on get;
- ``list[str]`` (or any list of picklable non-tensor objects, e.g. JSON values).

``get`` returns a dense tensor whenever every requested row has the same per-row shape and
dtype (so a ragged column whose rows happen to agree comes back dense), a list of tensors
otherwise, and a list for non-tensor columns. Both backends apply this one rule
(`assemble_rows`), which is what makes their results identical.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence, Union

import torch

from rlgraph.runtime.dataplane.errors import DataPlaneDied, DataPlaneError, dead_actors  # noqa: F401  # re-exported
from rlgraph.rows import Rows

__all__ = [
    "DataPlaneError",
    "ColumnData",
    "DataPlaneClient",
    "DataPlane",
    "DataPlaneHandle",
    "assemble_rows",
    "count_locality",
    "counted_apart",
    "dead_actors",
    "payload_bytes_in_this_process",
]

ColumnData = Union[torch.Tensor, list]
"""A column for some rows: a dense tensor, a list of per-row tensors (ragged) or a list of
non-tensor values (strings, JSON objects)."""


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


# Of those, the bytes whose storage is on this process's node and on another node, where the
# plane knows (TransferQueue: each row's storage unit and that unit's node).
_locality = [0, 0]
_apart = threading.local()  # a thread's own counts while it reads for a later call (`counted_apart`)


def count_locality(local: int, remote: int) -> None:
    box = getattr(_apart, "box", None)
    if box is not None:
        box[0] += local
        box[1] += remote
        return
    with _bytes_lock:
        _locality[0] += local
        _locality[1] += remote


@contextlib.contextmanager
def counted_apart() -> Iterator[list[int]]:
    """Within: this thread's local and cross-node bytes go to the yielded ``[local, remote]``, not
    the process's counts (a worker's read ahead of a call, counted for that call when it comes)."""
    box = [0, 0]
    _apart.box = box
    try:
        yield box
    finally:
        _apart.box = None


def locality_bytes_in_this_process() -> tuple[int, int]:
    """(bytes put to or got from storage on this node, bytes on other nodes) in this process so far."""
    return _locality[0], _locality[1]


def row_nbytes(value: ColumnData, rows: int) -> list[int]:
    """Payload bytes of each of `rows` rows of a column value (as `_nbytes` counts them)."""
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return [value.numel() * value.element_size() // max(rows, 1)] * rows
    items = value.unbind() if isinstance(value, torch.Tensor) else list(value)
    return [_nbytes([v]) for v in items]


_UNCOUNTED = (dict, list, tuple, int, float, bool, type(None))  # rows `_nbytes` counts as no bytes


def _nbytes(value: ColumnData) -> int:
    """Payload bytes of a column: a tensor's, each row tensor's, each string's UTF-8 and each bytes
    value's; other objects count nothing. Every put and get counts its columns (`_count_bytes`)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return sum(t.numel() * t.element_size() for t in value.unbind())
        return value.numel() * value.element_size()
    if type(value) is Rows and value.flat is not None:  # its flat tensor: no row views made to count them
        return value.flat.numel() * value.flat.element_size()
    # a column of one type of row, counted without a test per row (a get of 128 rows of six columns
    # spent ~80 us here, one isinstance after another)
    kinds = set(map(type, value))
    if len(kinds) == 1:
        kind = next(iter(kinds))
        if kind is str:
            return len("".join(value).encode())
        if kind is torch.Tensor:  # as the loop below counts a row tensor
            return sum(v.numel() * v.element_size() for v in value)
        if kind is bytes:
            return sum(map(len, value))
        if kind in _UNCOUNTED:
            return 0
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
    if type(value) is Rows and value.flat is not None and value and value.flat.is_contiguous():
        lengths = value.lengths  # 1-D views of one contiguous tensor, in order: one dtype, each contiguous
        if min(lengths) == max(lengths):
            return _Column("dense", value.flat.view(len(lengths), lengths[0]))
        return _Column("ragged", value)
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


_checked: tuple[int, ...] = ()  # the last tuple of rows `_check_rows` passed: a call's get and put check it once


def _check_rows(partition: str, rows: Sequence[int]) -> tuple[int, ...]:
    """`rows` as a tuple of ints, each once and none negative. Rows of Python ints (what the runtime
    sends) are taken as they are, without a conversion per row (1,024 rows: 50 us); a tuple just
    checked (the same object: a tuple cannot change) is not checked again."""
    global _checked
    if rows is _checked:
        return rows
    given = rows
    rows = rows if type(rows) is tuple else tuple(rows)
    if rows and set(map(type, rows)) != {int}:  # numpy or torch integers, bools
        try:
            rows = tuple(map(operator.index, rows))
        except TypeError:
            raise DataPlaneError(f"partition {partition!r}: rows must be integers, got "
                                 f"{[r for r in rows if not hasattr(r, '__index__')][:8]}") from None
    if len(set(rows)) != len(rows):
        raise DataPlaneError(f"partition {partition!r}: rows {list(rows)} contain duplicates")
    if rows and min(rows) < 0:
        raise DataPlaneError(f"partition {partition!r}: row ids must be >= 0, got {min(rows)}")
    if given is rows:
        _checked = rows
    return rows


# --------------------------------------------------------------------------- interfaces
class DataPlaneClient(ABC):
    """The worker side: write columns, read columns.

    The public methods check arguments, normalise columns and count payload bytes, then call
    the backend's ``_put``/``_get``; subclasses implement only those.
    """

    def put(self, partition: str, rows: Sequence[int], columns: Mapping[str, ColumnData]) -> None:
        """Write ``columns`` for ``rows`` of ``partition`` (each column has one entry per row, in
        the order of ``rows``). Rewriting a column of a row replaces it."""
        rows = _check_rows(partition, rows)
        if not columns:
            raise DataPlaneError(f"put to partition {partition!r} got no columns")
        if not rows:
            return
        norm = {name: _normalize(name, value, len(rows)) for name, value in columns.items()}
        self._put(partition, rows, norm)
        _count_bytes(sum(_nbytes(c.value) for c in norm.values()))

    def get(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> dict[str, ColumnData]:
        """Read ``columns`` of ``rows`` of ``partition``, in the order of ``rows``. Raises
        `DataPlaneError` if a requested cell was never written."""
        cols = tuple(columns)
        if not cols:
            raise DataPlaneError(f"get on partition {partition!r} needs columns")
        rows = _check_rows(partition, rows)
        if not rows:
            return {c: [] for c in cols}
        out = self._get(partition, rows, cols)
        _count_bytes(sum(_nbytes(v) for v in out.values()))
        return out

    def forget(self, partition: str) -> None:  # noqa: B027 - a client that remembers nothing
        """`partition` was cleared: drop what this client remembers of it (row lookups)."""

    def learn(self, partition: str, rows: Sequence[int], addresses: Any) -> None:  # noqa: B027 - nothing to learn
        """Where `rows` of `partition` are, as the driver's `DataPlane.addresses` gave it, so that
        this client's next put or get of them asks the plane nothing first."""

    def close(self) -> None:  # noqa: B027 - a client without connections has nothing to do
        """Release this client's connections (sockets, threads). The data stays."""

    @abstractmethod
    def _put(self, partition: str, rows: tuple[int, ...], columns: dict[str, _Column]) -> None: ...

    @abstractmethod
    def _get(self, partition: str, rows: tuple[int, ...], columns: tuple[str, ...]) -> dict[str, ColumnData]: ...


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
    def create_partition(self, partition: str, num_rows: int, homes: Sequence[int] | None = None,
                         lookup: bool = True) -> None:
        """Register ``partition`` with rows ``0..num_rows-1``. Puts to other rows fail.
        Raises if the partition already exists (``clear`` it first). ``homes[r]``: the storage
        unit (an index into `storage_nodes`) that keeps row ``r``; a plane whose storage follows
        the writer (the Ray store) ignores it. ``lookup=False``: every client that reaches its
        rows is given their `addresses` first (`DataPlaneClient.learn`), none looks them up by
        name, so the plane may place it where it likes (TransferQueue: on a cleared partition's
        rows, without asking its controller)."""

    def addresses(self, partition: str, rows: Sequence[int]) -> Any:
        """What a client needs to reach `rows` of `partition` without asking the plane (small and
        picklable: it travels with each op call, for the worker's `DataPlaneClient.learn`); None
        when the backend needs nothing."""
        return None

    def storage_nodes(self) -> tuple[str, ...]:
        """The Ray node of each storage unit, in unit order; () when rows cannot be given a home."""
        return ()

    def uses_shared_memory(self) -> bool:
        """Whether large tensor columns go through shared memory (`rlgraph.runtime.dataplane.shm`)."""
        return False

    @abstractmethod
    def clear(self, partition: str) -> None:
        """Drop ``partition``: its rows, payload and consumption. Unknown partitions are a no-op."""

    @abstractmethod
    def handle(self) -> DataPlaneHandle:
        """What a worker needs to connect: pass it to actors, call ``connect()`` there."""

    def actors(self) -> dict[str, Any]:
        """The plane's Ray actors by a name for people (watched for deaths by the runner)."""
        return {}

    def guest_host(self) -> Any:
        """The plane's actor that can host a guest object (`rlgraph.runtime.dataplane.guest`), or None."""
        return None

    def payload_bytes_in_this_process(self) -> int:
        """Column payload bytes that went through put/get in this (the driver's) process.
        Stays ~0 when workers put and get themselves and the driver only passes row ids."""
        return payload_bytes_in_this_process()

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
