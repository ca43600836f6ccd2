"""Columns a worker keeps in its own memory: what an op of its group reads next never travels.

An op's outputs go to the data plane so that other groups can read them; when the next reader is
an op of the same group (ref after generate on the actor, the update after both), the worker
already holds the values it just wrote. `LocalColumns` keeps, per partition, the per-row values
of the columns an op of the worker's group reads, exactly as the plane's ``get`` would return
them (the same normalisation on the way in, `assemble_rows` on the way out, JSON objects copied),
so a read served here is indistinguishable from one served by the plane, only cheaper: no
serialisation, no socket, no copy but the final stack. A ragged column one call wrote as `Rows`
(rlgraph.rows), read whole, is handed out as kept, not copied: its readers read it (an op gets it
padded, its own copy), and its padding, made by the first, serves the others.

The worker forgets a partition when the driver clears it (`rlgraph.runtime.fleet.Fleet.clear`,
sent after the step's calls, so a call still running is never robbed). Rows missing here (another
rank wrote them, or the worker restarted) are read from the plane.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch

from rlgraph.rows import Rows
from rlgraph.runtime.dataplane.base import ColumnData, _normalize, assemble_rows

__all__ = ["LocalColumns"]


class _Block:
    """One ``keep`` of one column: its rows and their values as normalised for a put (a dense tensor,
    or a list of per-row tensors or objects); where each row is, made when first needed."""

    __slots__ = ("rows", "value", "_at")

    def __init__(self, rows: tuple[int, ...], value: Any) -> None:
        self.rows, self.value, self._at = rows, value, None

    def at(self) -> dict[int, int]:
        if self._at is None:
            self._at = {r: i for i, r in enumerate(self.rows)}
        return self._at


class LocalColumns:
    """Per partition, per column: the blocks of rows this worker wrote (see the module).

    A column is kept as it was put, one block per ``keep`` (a dense column stays one tensor, not a
    tensor per row: 512 rows of eight columns took 1.8 ms to split row by row), and a read of the rows
    of one block, the common case (the next op reads what one call wrote), is one copy of it."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, list[_Block]]] = {}

    def keep(self, partition: str, rows: Sequence[int], columns: Mapping[str, ColumnData]) -> None:
        """Remember `columns` (one entry per row of `rows`, as for a plane's ``put``); rows kept
        again replace what was kept for them."""
        part = self._parts.setdefault(partition, {})
        rows = tuple(rows)
        for name, value in columns.items():
            col = _normalize(name, value, len(rows))
            part.setdefault(name, []).append(_Block(rows, col.value))

    def take(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> dict[str, ColumnData]:
        """The columns of `columns` held here for every row of `rows`, as the plane's ``get``
        returns them; the others are left out (read them from the plane)."""
        part = self._parts.get(partition)
        if not part:
            return {}
        rows = tuple(rows)
        out: dict[str, ColumnData] = {}
        for name in columns:
            blocks = part.get(name)
            if blocks:
                got = _gather(blocks, rows)
                if got is not None:
                    out[name] = got
        return out

    def forget(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def partitions(self) -> list[str]:
        return list(self._parts)


def _gather(blocks: list[_Block], rows: tuple[int, ...]) -> ColumnData | None:
    """`rows` of one column from its blocks (the last block holding a row has its value), as a get
    returns them; None when a row is held by none."""
    last = blocks[-1]
    if last.rows == rows:  # what one call wrote, read whole: a dense tensor copied (the body may change it)
        if type(last.value) is Rows:  # ragged rows of one tensor as they are: a body gets them padded, a copy
            return last.value
        return last.value.clone() if isinstance(last.value, torch.Tensor) else _assembled(last.value)
    where: dict[int, tuple[int, int]] = {}  # row -> (block, position in it)
    wanted = set(rows)
    for b, block in enumerate(blocks):
        for r, i in block.at().items():
            if r in wanted:
                where[r] = (b, i)
    if len(where) < len(rows):
        return None
    used = {b for b, _ in where.values()}
    dense = [blocks[b].value for b in used]
    if all(isinstance(v, torch.Tensor) for v in dense) and len({(v.shape[1:], v.dtype) for v in dense}) == 1:
        first = dense[0]
        got = torch.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
        for b in used:  # one indexed copy per block
            dest = [k for k, r in enumerate(rows) if where[r][0] == b]
            got[dest] = blocks[b].value[[where[rows[k]][1] for k in dest]]
        return got
    return _assembled([blocks[b].value[i] for b, i in (where[r] for r in rows)])


def _assembled(values: Sequence[Any]) -> ColumnData:
    """Per-row values as a get returns them (`assemble_rows`), JSON objects copied: a body may change
    what it was given."""
    values = list(values)
    if values and not isinstance(values[0], (torch.Tensor, str, bytes, int, float, bool)):
        values = copy.deepcopy(values)
    return assemble_rows(values)
