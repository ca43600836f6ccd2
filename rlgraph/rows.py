"""Rows of a ragged column: padding them into one tensor and cutting them out of one.

An op receives a ragged column (``responses``, ``[response_len]``) right-padded with zeros into
one tensor (or, where it takes the column ``as_rows``, as a `Rows`) and returns it either way;
between ops the runtime keeps and moves it as one tensor per row, each cut to its length. A column
read padded by several ops (``responses`` by the reference pass and the update) would be padded
again for every reader. `Rows` saves the
padding: the per-row tensors are views into one flat tensor, and a `Rows` keeps that tensor and
the lengths, so it can give the padded batch in one masked write, once (``padded``), without
joining the rows first. It is a list, so every reader of per-row tensors reads it as before from
Python; C code that reads a list's items directly needs it cut first (`Rows.cut`).

A `Rows` is read, never changed: a reader that changes a row tensor in place changes what every
later reader gets (as with any list of row tensors kept by the runtime), and the kept padding does
not follow. A `Rows` changed as a list (a row replaced, rows added) forgets its flat tensor and pads
its rows as any list's. Pickled, it is a plain list of views of its flat tensor, which is written
once (a list of views would write the whole flat tensor once a row).

Nothing here depends on the rest of rlgraph: the runtime (`rlgraph.runtime.invoke`, the data
plane) and the rollout (`rlgraph.ops.rollout.parts`) both use it.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

__all__ = ["Rows", "rows_of", "tensors", "joined", "pad_rows", "pad_flat", "trimmed_rows", "left_pad", "reads_flat",
           "READS_FLAT"]

READS_FLAT = "__rlgraph_reads_flat__"
_CUT_LOCK = threading.Lock()


def reads_flat(fn: Any) -> Any:
    """Mark an op body that reads the inputs it takes ``as_rows`` only through their `Rows.flat` and
    `Rows.lengths` (or `Rows.padded`, or as a list from Python): the runtime then gives them without
    cutting their row views first (a body that hands them to torch as a list, ``torch.cat(rows)``,
    must not be marked: uncut, such C code sees no rows). For a method, mark the function in the class;
    a wrapper made with ``functools.wraps`` copies the mark, so mark only what reads as said."""
    setattr(fn, READS_FLAT, True)
    return fn


class Rows(list):
    """1-D rows that are views into `flat`, in order, of `lengths` elements each (see the module).

    The views are made when the rows are first read as a list (an index, a loop, ``len`` aside, any
    list method), not when the `Rows` is made: most columns are only ever read through `flat` (the
    data plane's put, the padding for an op, the summaries), and cutting 512 views took 0.2-0.4 ms a
    column, a few ms a step at 64 x 8. Until then the list itself is empty, so C code that reads a
    list's items without asking it (torch's ``cat`` or ``stack`` given it directly) would see no rows:
    `rlgraph.runtime.invoke` gives a body its rows cut (`cut`), and rlgraph's own code reads a `Rows`
    through `flat`, or as a list by Python (``list(rows)``, a loop), which cuts it first."""

    __slots__ = ("flat", "lengths", "sums", "_padded", "_cut")

    def __init__(self, flat: torch.Tensor, lengths: Sequence[int], sums: Sequence[float] | None = None) -> None:
        """`sums`: each row's sum, where its maker has them without a pass over the elements (the
        reward: each row holds one score). They must be exactly what summing the row in float64 gives;
        the worker's summaries of an op's outputs (`rlgraph.runtime.worker`) read them instead of
        summing the rows. A `Rows` changed as a list forgets them, as it forgets `flat`."""
        if flat.dim() != 1:
            raise ValueError(f"Rows takes a 1-D flat tensor of the rows one after another, got shape "
                             f"{tuple(flat.shape)}")
        super().__init__()
        lengths = list(lengths)
        if sum(lengths) != flat.shape[0] or (lengths and min(lengths) < 0):  # what the views' split would refuse
            raise ValueError(f"Rows of lengths summing to {sum(lengths)} (smallest {min(lengths, default=0)}) "
                             f"cannot be cut from a flat tensor of {flat.shape[0]} elements; give each row's "
                             f"length, in order")
        if sums is not None and len(sums) != len(lengths):
            raise ValueError(f"Rows of {len(lengths)} rows given {len(sums)} row sums; give one sum a row, or none")
        self.flat: torch.Tensor | None = flat
        self.lengths = lengths
        self.sums: list[float] | None = None if sums is None else list(sums)
        self._padded: torch.Tensor | None = None
        self._cut = not lengths  # whether the list holds the views (`cut`)

    def cut(self) -> Rows:
        """The rows as a list's items, the views of `flat` made now if not yet (what C code that reads a
        list directly needs); itself. Threads may race to it: the views are made outside the lock (torch
        lets go of the GIL), put in under it, and the flag set only once they are in."""
        if not self._cut:
            views = self.flat.split(self.lengths)
            with _CUT_LOCK:
                if not self._cut:
                    list.extend(self, views)
                    self._cut = True
        return self

    def padded(self) -> torch.Tensor:
        """The rows right-padded with zeros, ``[rows, longest]`` (as ``pad_sequence`` gives them); the
        caller must not change it in place (clone it for a body). Kept for the next reader unless the
        padding would more than double the rows' memory (a long tail of lengths): then made anew each time."""
        if self._padded is not None:
            return self._padded
        padded = pad_flat(self.flat, self.lengths) if self.flat is not None else pad_rows(list(self))
        if padded is not None and (self.flat is None or padded.numel() <= 2 * max(self.flat.numel(), 1)):
            self._padded = padded
        return padded

    def shared(self) -> Rows:
        """A new `Rows` of the same row tensors (no copy; views only if these were cut already): a list of
        its own for a reader, which may change the list but not the tensors. Only for a `Rows` that still
        has its flat tensor."""
        out = Rows.__new__(Rows)
        if self._cut:
            list.extend(out, list.__iter__(self))
        # not the kept padding: a reader may change what `padded` gives it, which no version counter of
        # the rows tells; the lengths its own list
        out.flat, out.lengths, out._padded, out._cut = self.flat, list(self.lengths), None, self._cut
        out.sums = self.sums  # the same tensors: the same sums
        return out

    def __len__(self) -> int:
        return list.__len__(self) if self._cut else len(self.lengths)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.flat is not None:  # the flat tensor once (a view's pickle holds its whole storage)
            return _split, (self.flat, self.lengths)
        return list, (list(self),)

    def __copy__(self) -> list:
        return list(self)

    def __radd__(self, other: Any) -> Any:  # ``a_list + rows``: cut, then the list's own concatenation
        self.cut()
        return NotImplemented


def _split(flat: torch.Tensor, lengths: list[int]) -> list:
    """An unpickled `Rows`: a plain list of views of `flat`."""
    return list(flat.split(lengths)) if lengths else []


def _cutting(name: str) -> Any:
    base = getattr(list, name)

    def method(self: Rows, *args: Any, **kwargs: Any) -> Any:
        if not self._cut:
            self.cut()
        for a in args:  # another Rows read by the list's C code (``==``, ``+``) is cut too
            if type(a) is Rows and not a._cut:
                a.cut()
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


def _forgetting(name: str) -> Any:
    base = getattr(list, name)

    def method(self: Rows, *args: Any, **kwargs: Any) -> Any:
        if not self._cut:
            self.cut()
        self.flat, self._padded, self.sums = None, None, None  # the rows no longer are `flat`'s views, in order
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


torch.serialization.add_safe_globals([_split])  # a `Rows` in a torch.save'd file loads with weights_only

for _name in ("__getitem__", "__iter__", "__reversed__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__",
              "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "__repr__", "index", "count", "copy"):
    setattr(Rows, _name, _cutting(_name))

for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(Rows, _name, _forgetting(_name))


def rows_of(values: Any, dtype: torch.dtype) -> Rows:
    """A ragged column's stored values (a `Rows`, a list of 1-D row tensors, or one dense ``[rows, width]``
    tensor when every row had the same length) as a `Rows` of `dtype`: a `Rows` of that dtype shares its
    row tensors (`Rows.shared`), anything else is joined (or converted) once and cut into views."""
    if type(values) is Rows and values.flat is not None:
        if values.flat.dtype is dtype:
            return values.shared()
        return Rows(values.flat.to(dtype), values.lengths)
    if isinstance(values, torch.Tensor):
        if values.dim() != 2:
            raise ValueError(f"rows of one ragged dimension come as a [rows, width] tensor, got shape "
                             f"{tuple(values.shape)}")
        return Rows(values.to(dtype).reshape(-1), [values.shape[1]] * values.shape[0])
    rows = tensors(values)
    if any(r.dim() != 1 for r in rows):
        raise ValueError(f"rows of one ragged dimension are 1-D tensors, got shapes "
                         f"{sorted({tuple(r.shape) for r in rows if r.dim() != 1})}")
    if not rows:
        return Rows(torch.empty((0,), dtype=dtype), [])
    return Rows(torch.cat(rows).to(dtype), [r.shape[0] for r in rows])


def tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    """A column's stored rows as tensors: tensors as they are, anything else (lists of numbers, arrays)
    through ``torch.as_tensor``."""
    return [v if type(v) is torch.Tensor else torch.as_tensor(v) for v in values]


def joined(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows' elements one after another, row-major, as one 1-D tensor: a `Rows`'s flat tensor as
    it is, else one ``cat`` (rows of different numbers of dimensions, or 0-d ones, flattened first)."""
    if type(rows) is Rows and rows.flat is not None:
        return rows.flat
    try:
        return torch.cat(list(rows)).reshape(-1)  # rows of one number of dimensions: row-major already
    except RuntimeError:
        return torch.cat([r.reshape(-1) for r in rows])


def pad_flat(flat: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Rows of `lengths` elements, one after another in 1-D `flat`, right-padded with zeros to
    ``[len(lengths), longest]`` in one masked write (row-major: each row's elements, in order)."""
    width = max(lengths, default=0)
    out = flat.new_zeros((len(lengths), width))
    if width:
        out[torch.arange(width) < torch.tensor(lengths).unsqueeze(1)] = flat
    return out


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """1-D rows right-padded with zeros to ``[len(rows), longest]`` (what ``pad_sequence`` gives),
    in one copy into place, not one per row; a `Rows` without joining its rows again. None when the
    rows are not all 1-D. The joined rows tell that without a look at each row: ``cat`` refuses 0-d
    rows and rows of different numbers of dimensions, and gives 1-D only for 1-D rows."""
    if type(rows) is Rows and rows.flat is not None:
        return rows.padded()
    try:
        flat = torch.cat(list(rows))
    except RuntimeError:
        return None
    if flat.dim() != 1:
        return None
    return pad_flat(flat, [r.shape[0] for r in rows])  # not len(r): a tensor's __len__ is Python, ~1 us


def trimmed_rows(padded: torch.Tensor, lengths: Sequence[int]) -> Rows:
    """Each row of right-padded `padded` [rows, width] cut to its length (each at most the width):
    one masked copy, split into views (a slice a row took 0.24 ms for 128 rows, this 0.09)."""
    lengths = list(lengths)
    if not lengths:
        return Rows(padded.new_zeros((0,)), [])
    keep = torch.arange(padded.shape[1]) < torch.tensor(lengths).unsqueeze(1)
    return Rows(padded[keep], lengths)


def left_pad(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompts` as one left-padded batch (generation continues from the last column) and its
    attention mask, both ``long`` [rows, longest prompt]: the rows joined, then written into place
    by one masked assignment (``pad_sequence``'s left padding took 0.3 ms for 128 rows)."""
    lengths = torch.tensor([p.shape[0] for p in prompts], dtype=torch.long)
    width = int(lengths.max()) if len(prompts) else 0
    mask = (torch.arange(width) >= (width - lengths).unsqueeze(1)).long()
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    if width:
        flat = prompts.flat if type(prompts) is Rows and prompts.flat is not None else torch.cat(list(prompts))
        ids[mask.bool()] = flat.long()  # row-major: each row's tokens fill its last columns
    return ids, mask
