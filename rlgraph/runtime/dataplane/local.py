"""Columns a worker keeps in its own memory: what an op of its group reads next never travels.

An op's outputs go to the data plane so that other groups can read them; when the next reader is
an op of the same group (ref after generate on the actor, the update after both), the worker
already holds the values it just wrote. `LocalColumns` keeps, per partition, the per-row values
of the columns an op of the worker's group reads, exactly as the plane's ``get`` would return
them (the same normalisation on the way in, `assemble_rows` on the way out, JSON objects copied),
so a read served here is indistinguishable from one served by the plane, only cheaper: no
serialisation, no socket, no copy but the final stack.

The worker forgets a partition when the driver clears it (`rlgraph.runtime.fleet.Fleet.clear`,
sent after the step's calls, so a call still running is never robbed). Rows missing here (another
rank wrote them, or the worker restarted) are read from the plane.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch

from rlgraph.runtime.dataplane.base import ColumnData, _normalize, assemble_rows

__all__ = ["LocalColumns"]


class LocalColumns:
    """Per partition, per column, per row: the values this worker wrote (see the module)."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, dict[int, Any]]] = {}

    def keep(self, partition: str, rows: Sequence[int], columns: Mapping[str, ColumnData]) -> None:
        """Remember `columns` (one entry per row of `rows`, as for a plane's ``put``)."""
        part = self._parts.setdefault(partition, {})
        for name, value in columns.items():
            col = _normalize(name, value, len(rows))
            per_row = list(col.value.unbind(0)) if isinstance(col.value, torch.Tensor) else list(col.value)
            part.setdefault(name, {}).update(zip(rows, per_row))

    def take(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> dict[str, ColumnData]:
        """The columns of `columns` held here for every row of `rows`, as the plane's ``get``
        returns them; the others are left out (read them from the plane)."""
        part = self._parts.get(partition)
        if not part:
            return {}
        out: dict[str, ColumnData] = {}
        for name in columns:
            held = part.get(name)
            if held is None or any(r not in held for r in rows):
                continue
            values = [held[r] for r in rows]
            if values and not isinstance(values[0], (torch.Tensor, str, bytes, int, float, bool)):
                values = copy.deepcopy(values)  # JSON objects: a body may change what it was given
            out[name] = assemble_rows(values)
        return out

    def forget(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def partitions(self) -> list[str]:
        return list(self._parts)
