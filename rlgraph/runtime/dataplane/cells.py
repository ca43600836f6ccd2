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
  is data, never code, whoever wrote it.

`decode` applies `assemble_rows`' rule: a dense tensor when every row has one shape and dtype,
a list of per-row tensors otherwise, a list for objects.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import torch

from rlgraph.runtime.dataplane.base import ColumnData, DataPlaneError, _Column

__all__ = ["decode", "encode", "payload_nbytes"]

_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_TENSOR, _STR, _BYTES, _JSON = ord("t"), ord("s"), ord("b"), ord("j")
_HEAD = struct.Struct("<cBB")  # tag, dtype code, number of dimensions
_SHAPES = [struct.Struct(f"<{n}I") for n in range(9)]


def _header(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    code = _CODE.get(dtype)
    if code is None:
        raise DataPlaneError(f"tensors of dtype {dtype} cannot go through the data plane; "
                             f"use one of {[str(d).removeprefix('torch.') for d in _DTYPES]}")
    if len(shape) >= len(_SHAPES):
        raise DataPlaneError(f"a row of {len(shape)} dimensions is more than the plane takes ({len(_SHAPES) - 1})")
    return _HEAD.pack(b"t", code, len(shape)) + _SHAPES[len(shape)].pack(*shape)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor, one copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


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


def decode(cells: Sequence[Any]) -> ColumnData:
    """A column from its cells: a dense tensor, a list of per-row tensors, or a list of objects."""
    if not cells:
        return []
    foreign = next((c for c in cells if type(c) not in (bytes, bytearray, memoryview)), None)
    if foreign is not None:
        raise DataPlaneError(f"the data plane returned a cell of type {type(foreign).__name__} where rlgraph's "
                             f"encoding was expected; a process other than rlgraph's wrote this column")
    if cells[0][0] != _TENSOR:
        return _objects(cells)
    heads = []
    bodies = []
    for c in cells:
        tag, code, ndim = _HEAD.unpack_from(c)
        if tag != b"t":
            raise DataPlaneError("a column mixes tensors and objects in the data plane")
        shape = _SHAPES[ndim].unpack_from(c, _HEAD.size)
        heads.append((code, shape))
        bodies.append(memoryview(c)[_HEAD.size + 4 * ndim:])
    codes = {code for code, _ in heads}
    shapes = {shape for _, shape in heads}
    joined = bytearray().join(bodies)
    if len(codes) == 1:
        dtype = _DTYPES[heads[0][0]]
        flat = torch.frombuffer(joined, dtype=dtype) if joined else torch.empty(0, dtype=dtype)
        if len(shapes) == 1:
            return flat.view(len(cells), *heads[0][1])
        if all(len(shape) == 1 for shape in shapes):  # rows of one dimension: split's parts as they are
            return list(torch.split(flat, [shape[0] for _, shape in heads]))
        sizes = [_numel(shape) for _, shape in heads]
        return [part.view(shape) for part, (_, shape) in zip(torch.split(flat, sizes), heads)]
    # rows of several dtypes (rows put by different calls): each its own tensor
    out = []
    for (code, shape), body in zip(heads, bodies):
        dtype = _DTYPES[code]
        out.append(torch.frombuffer(bytearray(body), dtype=dtype).view(shape) if len(body)
                   else torch.empty(shape, dtype=dtype))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
