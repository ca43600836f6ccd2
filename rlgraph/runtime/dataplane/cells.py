"""The cell codec of the TransferQueue plane: one row of one column as one ``bytes`` value.

TransferQueue stores a table of cells (row x field). Handed tensors, its messages encode and
decode every cell as a tensor of its own in Python (about 14 us a cell each way, plus the
nested-tensor packing of a get), which made a column's cost grow with its rows far more than
with its bytes. Handed ``bytes``, the message codec (msgspec) packs and unpacks a whole list
in C, and the storage unit keeps the values as they come. So the TQ client encodes each cell
here, and a get turns a list of cells back into a column with one join and one ``frombuffer``:

- a tensor row: ``b"t"``, a dtype code, its number of dimensions and its shape (uint32s), then
  its raw bytes;
- a string: ``b"s"`` then its UTF-8; bytes: ``b"b"`` then themselves;
- any other object: ``b"j"`` then its JSON (numbers, booleans, None, and lists and dicts of
  them; a tuple comes back as a list and a dict's keys as strings). Nothing is pickled: a cell
  is data, never code, whoever wrote it;
- a tensor row whose bytes lie in a shared-memory segment (`rlgraph.runtime.dataplane.shm`):
  ``b"m"``, the tensor header, the row's byte offset in the segment (uint64), then the segment's
  name. `shared` writes these cells for a column `write` laid out in the segment; `decode` reads
  them through the segments it is given, copying each run of adjacent rows once.

`decode` applies `assemble_rows`' rule: a dense tensor when every row has one shape and dtype,
a list of per-row tensors otherwise, a list for objects.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from rlgraph.runtime.dataplane.base import ColumnData, DataPlaneError, _Column, _nbytes

__all__ = ["any_shared", "decode", "encode", "payload_nbytes", "shared", "write"]

_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_TENSOR, _STR, _BYTES, _JSON, _SHARED = ord("t"), ord("s"), ord("b"), ord("j"), ord("m")
_HEAD = struct.Struct("<cBB")  # tag, dtype code, number of dimensions
_SHAPES = [struct.Struct(f"<{n}I") for n in range(9)]
_OFFSET = struct.Struct("<Q")  # a shared row's byte offset in its segment


class Segments(Protocol):
    """What `decode` reads shared rows through: a segment's bytes by its name."""

    def view(self, name: str) -> Any: ...


def _header(dtype: torch.dtype, shape: Sequence[int], tag: bytes = b"t") -> bytes:
    code = _CODE.get(dtype)
    if code is None:
        raise DataPlaneError(f"tensors of dtype {dtype} cannot go through the data plane; "
                             f"use one of {[str(d).removeprefix('torch.') for d in _DTYPES]}")
    if len(shape) >= len(_SHAPES):
        raise DataPlaneError(f"a row of {len(shape)} dimensions is more than the plane takes ({len(_SHAPES) - 1})")
    return _HEAD.pack(tag, code, len(shape)) + _SHAPES[len(shape)].pack(*shape)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor, one copy."""
    return _bytes_of(t).tobytes()


def encode(col: _Column) -> list[bytes]:
    """The cells of a normalised column, one per row."""
    if col.kind == "dense":
        t: torch.Tensor = col.value
        rows = t.shape[0]
        head = _header(t.dtype, t.shape[1:])
        data = _raw(t)
        n = len(data) // rows if rows else 0
        return [head + data[i * n:(i + 1) * n] for i in range(rows)]
    if col.kind == "ragged":
        values: list[torch.Tensor] = col.value
        data = _raw(torch.cat(values if values[0].dim() == 1 else [v.reshape(-1) for v in values]))
        size = values[0].element_size()
        heads: dict[tuple[int, ...], bytes] = {}
        out = []
        start = 0
        for v in values:
            shape = tuple(v.shape)
            head = heads.get(shape)
            if head is None:
                head = heads[shape] = _header(v.dtype, shape)
            end = start + v.numel() * size
            out.append(head + data[start:end])
            start = end
        return out
    return [_object(v) for v in col.value]


def write(col: _Column, buffer: Any, offset: int) -> None:
    """Copy a tensor column's rows, one after another, into writable `buffer` at `offset`.

    The copies are numpy's (one thread): torch's ``copy_`` of a large tensor runs on its OpenMP
    threads, which then spin for a while after the copy, taking the CPU from the storage unit
    that the put's request goes to next (on 2 cores a put's round trip took 2-4 ms longer)."""
    values = [col.value] if col.kind == "dense" else col.value
    at = offset
    for v in values:
        raw = _bytes_of(v)
        if raw.size:
            np.copyto(np.frombuffer(buffer, dtype=np.uint8, count=raw.size, offset=at), raw)
        at += raw.size


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 array (no copy when it is contiguous already)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def shared(col: _Column, name: str, offset: int) -> list[bytes]:
    """The cells of a tensor column that `write` put into segment `name` at `offset`."""
    tail = name.encode()
    if col.kind == "dense":
        t: torch.Tensor = col.value
        head = _header(t.dtype, t.shape[1:], b"m")
        n = _nbytes(t) // t.shape[0] if t.shape[0] else 0
        return [head + _OFFSET.pack(offset + i * n) + tail for i in range(t.shape[0])]
    values: list[torch.Tensor] = col.value
    size = values[0].element_size()
    heads: dict[tuple[int, ...], bytes] = {}
    out = []
    for v in values:
        shape = tuple(v.shape)
        head = heads.get(shape)
        if head is None:
            head = heads[shape] = _header(v.dtype, shape, b"m")
        out.append(head + _OFFSET.pack(offset) + tail)
        offset += v.numel() * size
    return out


def _object(v: Any) -> bytes:
    if type(v) is str:
        return b"s" + v.encode()
    if type(v) is bytes:
        return b"b" + v
    try:
        return b"j" + json.dumps(v, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise DataPlaneError(f"a {type(v).__name__} value cannot go through the data plane ({e}); columns of "
                             f"objects hold strings, bytes, numbers, booleans, None and lists and dicts of them") from None


def any_shared(cells: Sequence[Any]) -> bool:
    """Whether some of a column's cells are shared rows (descriptors, `shared`)."""
    return any(c[0] == _SHARED for c in cells if c)


def payload_nbytes(cells: Sequence[bytes]) -> list[int]:
    """Bytes of each cell (header included: a few bytes a row)."""
    return [len(c) for c in cells]


def _objects(cells: Sequence[Any]) -> list[Any]:
    out = []
    for c in cells:
        tag = c[0]
        if tag == _STR:
            out.append(bytes(c[1:]).decode())
        elif tag == _JSON:
            out.append(json.loads(bytes(c[1:])))
        elif tag == _BYTES:
            out.append(bytes(c[1:]))
        elif tag == _TENSOR:
            raise DataPlaneError("a column mixes tensors and objects in the data plane")
        else:
            raise DataPlaneError(f"a cell tagged {bytes(c[:1])!r} is not in rlgraph's encoding; a process other "
                                 f"than rlgraph's wrote this column")
    return out


def decode(cells: Sequence[Any], segments: Segments | None = None) -> ColumnData:
    """A column from its cells: a dense tensor, a list of per-row tensors, or a list of objects.
    Shared rows (``b"m"``) are read through `segments`."""
    if not cells:
        return []
    foreign = next((c for c in cells if type(c) not in (bytes, bytearray, memoryview)), None)
    if foreign is not None:
        raise DataPlaneError(f"the data plane returned a cell of type {type(foreign).__name__} where rlgraph's "
                             f"encoding was expected; a process other than rlgraph's wrote this column")
    if cells[0][0] not in (_TENSOR, _SHARED):
        return _objects(cells)
    if cells[0][0] == _SHARED and segments is not None:
        uniform = _uniform_shared(cells)
        if uniform is not None:  # one put's rows of one shape, in order: one copy, no per-row work
            code, shape, name, offset, nbytes = uniform
            return _shaped(_copy_runs([(name, offset, nbytes)], segments), [(code, shape)] * len(cells), len(cells))
    heads = []
    bodies: list[Any] = []
    places: list[tuple[str, int, int] | None] = []  # a shared row's (segment, offset, bytes)
    for c in cells:
        tag, code, ndim = _HEAD.unpack_from(c)
        shape = _SHAPES[ndim].unpack_from(c, _HEAD.size)
        start = _HEAD.size + 4 * ndim
        if tag == b"t":
            bodies.append(memoryview(c)[start:])
            places.append(None)
        elif tag == b"m":
            offset, = _OFFSET.unpack_from(c, start)
            places.append((bytes(c[start + _OFFSET.size:]).decode(), offset, _numel(shape) * _DTYPES[code].itemsize))
            bodies.append(None)
        else:
            raise DataPlaneError("a column mixes tensors and objects in the data plane")
        heads.append((code, shape))
    if any(p is not None for p in places):
        if segments is None:
            raise DataPlaneError("a column's rows are in shared memory, but this client reads none: a client on "
                                 "another machine, or one connected without the plane's segments")
        if all(p is not None for p in places) and len({code for code, _ in heads}) == 1:
            return _shaped(_copy_runs(places, segments), heads, len(cells))
        bodies = [b if p is None else memoryview(segments.view(p[0]))[p[1]:p[1] + p[2]]
                  for b, p in zip(bodies, places)]
    codes = {code for code, _ in heads}
    if len(codes) == 1:
        joined = bytearray().join(bodies)
        return _shaped(torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8),
                       heads, len(cells))
    # rows of several dtypes (rows put by different calls): each its own tensor
    out = []
    for (code, shape), body in zip(heads, bodies):
        dtype = _DTYPES[code]
        out.append(torch.frombuffer(bytearray(body), dtype=dtype).view(shape) if len(body)
                   else torch.empty(shape, dtype=dtype))
    return out


def _uniform_shared(cells: Sequence[Any]) -> tuple[int, tuple[int, ...], str, int, int] | None:
    """(dtype code, row shape, segment, first offset, bytes) when every cell is a shared row of one
    dtype and shape in one segment, each row right after the one before (what one put writes);
    else None. Checked on all cells at once, as one array."""
    first = cells[0]
    size = len(first)
    if any(len(c) != size for c in cells):
        return None
    tag, code, ndim = _HEAD.unpack_from(first)
    if ndim >= len(_SHAPES):
        return None
    at = _HEAD.size + 4 * ndim  # where the offset starts
    table = np.frombuffer(b"".join(cells), dtype=np.uint8).reshape(len(cells), size)
    fixed = np.concatenate([table[:, :at], table[:, at + _OFFSET.size:]], axis=1)
    if not (fixed == fixed[0]).all():
        return None
    offsets = table[:, at:at + _OFFSET.size].copy().view("<u8").ravel()
    shape = _SHAPES[ndim].unpack_from(first, _HEAD.size)
    row = _numel(shape) * _DTYPES[code].itemsize
    if len(offsets) > 1 and not (np.diff(offsets) == row).all():
        return None
    return code, shape, bytes(first[at + _OFFSET.size:]).decode(), int(offsets[0]), row * len(cells)


def _copy_runs(places: list[Any], segments: Segments) -> torch.Tensor:
    """The bytes of shared rows in order, copied once per run of rows adjacent in one segment."""
    runs: list[list[Any]] = []
    for name, offset, n in places:
        last = runs[-1] if runs else None
        if last is not None and last[0] == name and last[1] + last[2] == offset:
            last[2] += n
        else:
            runs.append([name, offset, n])
    out = torch.empty(sum(r[2] for r in runs), dtype=torch.uint8)
    dst = out.numpy()
    at = 0
    for name, offset, n in runs:
        if n:
            np.copyto(dst[at:at + n], np.frombuffer(segments.view(name), dtype=np.uint8, count=n, offset=offset))
        at += n
    return out


def _shaped(flat: torch.Tensor, heads: list[tuple[int, tuple[int, ...]]], rows: int) -> ColumnData:
    """Rows of one dtype from their bytes (uint8, in order): dense when they agree in shape."""
    dtype = _DTYPES[heads[0][0]]
    flat = flat.view(dtype) if flat.numel() else torch.empty(0, dtype=dtype)
    shapes = {shape for _, shape in heads}
    if len(shapes) == 1:
        return flat.view(rows, *heads[0][1])
    if all(len(shape) == 1 for shape in shapes):  # rows of one dimension: split's parts as they are
        return list(torch.split(flat, [shape[0] for _, shape in heads]))
    sizes = [_numel(shape) for _, shape in heads]
    return [part.view(shape) for part, (_, shape) in zip(torch.split(flat, sizes), heads)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
