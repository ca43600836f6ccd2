"""`RayObjectStoreDataPlane`: the data plane on Ray's object store plus one tracker actor.

Design: a worker's ``put`` stores each column's payload with ``ray.put`` *in the worker* and
sends only the `ObjectRef`\\ s to `_RowTracker`, a CPU-free actor that keeps, per partition,
which (row, column) cells exist (ref + position inside that ref's payload). ``get`` asks it
where the cells are, then fetches the refs straight from the object store. Payload never passes through the tracker or the
driver, the same property TransferQueue gives.

Lifetime: a payload lives while its partition exists **and** the worker process that put it
is alive (Ray's ownership model; ``ray.put(..., _owner=...)`` was removed in Ray 2.56). Reading
a cell whose writer has exited raises `DataPlaneError` saying so. In rlgraph's runtime the
worker groups live for the whole run, so this holds; a backend that must survive worker exits
should use TransferQueue, whose storage units own the data. Rewriting a cell keeps the old
payload alive until the partition is cleared (the tracker only appends refs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray
import ray.exceptions
import torch

from rlgraph.runtime.dataplane.base import (
    ColumnData,
    DataPlane,
    DataPlaneClient,
    DataPlaneDied,
    DataPlaneError,
    DataPlaneHandle,
    _Column,
    assemble_rows,
)

__all__ = ["RayObjectStoreDataPlane", "RayObjectStoreHandle"]

_MAX_LISTED = 8  # rows named in an error message before "..."
TRACKER = "Ray-store row tracker"


def _listed(rows: list[int]) -> str:
    head = ", ".join(map(str, rows[:_MAX_LISTED]))
    return f"[{head}{', ...' if len(rows) > _MAX_LISTED else ''}] ({len(rows)} rows)"


class _Partition:
    """Tracker state of one partition. ``cells[col][row]`` is (ref index, position) or None."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.refs: list[ray.ObjectRef] = []  # one per (put, column)
        self.ref_index: dict[str, np.ndarray] = {}  # col -> [num_rows] int64, -1 = missing
        self.position: dict[str, np.ndarray] = {}  # col -> [num_rows] int64


@ray.remote(num_cpus=0)
class _RowTracker:
    """Metadata only: refs and flags, never payload (the refs are borrowed, not fetched).

    Errors are returned as strings rather than raised, so the client re-raises them as a plain
    `DataPlaneError` instead of a Ray task error wrapping one.
    """

    def __init__(self) -> None:
        self._parts: dict[str, _Partition] = {}

    def create_partition(self, partition: str, num_rows: int) -> str | None:
        if partition in self._parts:
            return f"partition {partition!r} already exists; clear it before creating it again"
        self._parts[partition] = _Partition(num_rows)
        return None

    def _rows_problem(self, partition: str, rows: list[int]) -> str | None:
        part = self._parts.get(partition)
        if part is None:
            return f"partition {partition!r} does not exist; call create_partition first"
        bad = [r for r in rows if r >= part.num_rows]
        if bad:
            return (f"rows {_listed(bad)} are not in partition {partition!r}, "
                    f"which has rows 0..{part.num_rows - 1}")
        return None

    def register(self, partition: str, rows: list[int], refs: dict[str, ray.ObjectRef]) -> str | None:
        problem = self._rows_problem(partition, rows)
        if problem:
            return problem
        part = self._parts[partition]
        idx = np.asarray(rows, dtype=np.int64)
        for col, ref in refs.items():
            if col not in part.ref_index:
                part.ref_index[col] = np.full(part.num_rows, -1, dtype=np.int64)
                part.position[col] = np.zeros(part.num_rows, dtype=np.int64)
            part.ref_index[col][idx] = len(part.refs)
            part.position[col][idx] = np.arange(len(rows))
            part.refs.append(ref)
        return None

    def locate(self, partition: str, rows: list[int], columns: list[str]) -> tuple[str | None, Any]:
        """-> (problem, {col: (refs, [(ref slot, position) per row])})."""
        problem = self._rows_problem(partition, rows)
        if problem:
            return problem, None
        part = self._parts[partition]
        idx = np.asarray(rows, dtype=np.int64)
        out = {}
        for col in columns:
            ref_idx = part.ref_index.get(col)
            missing = list(rows) if ref_idx is None else idx[ref_idx[idx] < 0].tolist()
            if missing:
                return (f"column {col!r} was never written for rows {_listed(missing)} of "
                        f"partition {partition!r}; get only what an op upstream has put"), None
            used = ref_idx[idx]
            slots, inverse = np.unique(used, return_inverse=True)
            out[col] = ([part.refs[s] for s in slots.tolist()],
                        list(zip(inverse.tolist(), part.position[col][idx].tolist())))
        return None, out

    def clear(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def partitions(self) -> list[str]:
        return sorted(self._parts)


def _take(payload: Any, positions: list[int]) -> list[Any]:
    if isinstance(payload, torch.Tensor):
        return list(payload[torch.as_tensor(positions, dtype=torch.long)].unbind(0))
    return [payload[p] for p in positions]


class _RayStoreClient(DataPlaneClient):
    """Worker side: ``ray.put`` here, refs to the tracker, fetch by ref."""

    def __init__(self, tracker: ray.actor.ActorHandle, op_timeout_s: float) -> None:
        self._tracker = tracker
        self._timeout = op_timeout_s

    def _call(self, ref: ray.ObjectRef, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self._timeout)
        except ray.exceptions.GetTimeoutError:
            raise DataPlaneError(f"timed out after {self._timeout}s waiting for the row tracker to {what}") from None
        except ray.exceptions.RayActorError:
            raise DataPlaneDied([TRACKER], f"asked to {what}") from None

    def _put(self, partition: str, rows: tuple[int, ...], columns: dict[str, _Column]) -> None:
        refs = {name: ray.put(col.value) for name, col in columns.items()}
        # refs inside a dict are passed as refs (borrowed by the tracker), not resolved
        problem = self._call(
            self._tracker.register.remote(partition, list(rows), refs),
            f"register columns {sorted(columns)} of partition {partition!r}",
        )
        if problem:
            raise DataPlaneError(problem)

    def _get(self, partition: str, rows: tuple[int, ...], columns: tuple[str, ...]) -> dict[str, ColumnData]:
        problem, where = self._call(
            self._tracker.locate.remote(partition, list(rows), list(columns)),
            f"locate columns {list(columns)} of partition {partition!r}",
        )
        if problem:
            raise DataPlaneError(problem)
        out: dict[str, ColumnData] = {}
        for col in columns:
            refs, cells = where[col]
            try:
                payloads = ray.get(refs, timeout=self._timeout)
            except ray.exceptions.GetTimeoutError:
                raise DataPlaneError(
                    f"timed out after {self._timeout}s fetching column {col!r} of partition {partition!r}"
                ) from None
            except ray.exceptions.ObjectLostError as e:
                raise DataPlaneError(
                    f"column {col!r} of partition {partition!r} is lost: the worker that put it "
                    f"exited (Ray frees objects with their owner): {type(e).__name__}"
                ) from None
            out[col] = self._assemble(payloads, cells)
        return out

    @staticmethod
    def _assemble(payloads: list[Any], cells: list[tuple[int, int]]) -> ColumnData:
        if len(payloads) == 1 and isinstance(payloads[0], torch.Tensor):
            # fast path: all rows from one dense put
            return payloads[0][torch.as_tensor([p for _, p in cells], dtype=torch.long)]
        values = [None] * len(cells)
        by_slot: dict[int, list[int]] = {}
        for i, (slot, _) in enumerate(cells):
            by_slot.setdefault(slot, []).append(i)
        for slot, idxs in by_slot.items():
            for i, v in zip(idxs, _take(payloads[slot], [cells[i][1] for i in idxs])):
                values[i] = v
        return assemble_rows(values)


@dataclass(frozen=True)
class RayObjectStoreHandle(DataPlaneHandle):
    """Picklable: the tracker's actor handle and the timeout for every wait."""

    tracker: Any
    op_timeout_s: float = 60.0

    def connect(self) -> DataPlaneClient:
        return _RayStoreClient(self.tracker, self.op_timeout_s)


class RayObjectStoreDataPlane(_RayStoreClient, DataPlane):
    """Driver side of the Ray object-store backend. ``start()`` creates the tracker actor
    (``num_cpus=0``: it needs no CPU reservation); ``close()`` kills it, freeing all payload."""

    def __init__(self, tracker: ray.actor.ActorHandle, op_timeout_s: float = 60.0) -> None:
        super().__init__(tracker, op_timeout_s)
        self._owner_pid = os.getpid()
        self._closed = False

    @classmethod
    def start(cls, op_timeout_s: float = 60.0) -> "RayObjectStoreDataPlane":
        """Start the tracker in the connected Ray cluster (call ``ray.init`` first)."""
        if not ray.is_initialized():
            raise DataPlaneError("RayObjectStoreDataPlane.start() needs Ray: call ray.init() first")
        plane = cls(_RowTracker.remote(), op_timeout_s)
        plane._call(plane._tracker.partitions.remote(), "start")
        return plane

    def create_partition(self, partition: str, num_rows: int, homes: Sequence[int] | None = None,
                         lookup: bool = True) -> None:
        # homes and lookup are ignored: each object already lives on the node of the worker that put it
        if num_rows < 1:
            raise DataPlaneError(f"partition {partition!r}: num_rows must be >= 1, got {num_rows}")
        problem = self._call(self._tracker.create_partition.remote(partition, int(num_rows)),
                             f"create partition {partition!r}")
        if problem:
            raise DataPlaneError(problem)

    def clear(self, partition: str) -> None:
        self._call(self._tracker.clear.remote(partition), f"clear partition {partition!r}")

    def handle(self) -> RayObjectStoreHandle:
        return RayObjectStoreHandle(self._tracker, self._timeout)

    def actors(self) -> dict[str, Any]:
        return {TRACKER: self._tracker}

    def close(self) -> None:
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        ray.kill(self._tracker)
