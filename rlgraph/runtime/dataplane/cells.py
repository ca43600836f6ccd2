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
  name. `shared` writes these cells for a column `write` laid out in the segment; `decode` returns
  tensors over the segments' mappings (`Segments.lease`): no copy, except a dense column whose
  rows lie in several runs (several puts, or rows out of order), which is joined into one tensor.

Cells whose headers agree (a dense column's rows; a ragged column's rows of one dtype) are parsed
as one array, not one cell at a time (`_dense_rows`, `_ragged_rows`, `_shared_table`).

`decode` applies `assemble_rows`' rule: a dense tensor when every row has one shape and dtype,
a list of per-row tensors otherwise, a list for objects.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import json
import operator
import os
import queue
import struct
import threading
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from rlgraph.rows import Rows, joined
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
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps with a separator builds an encoder per call
_OFFSET = struct.Struct("<Q")  # a shared row's byte offset in its segment


class Segments(Protocol):
    """What `decode` reads shared rows through (`rlgraph.runtime.dataplane.shm.Segments`)."""

    def lease(self, name: str) -> Any:
        """A writable mapping of segment `name` that no later put changes while a tensor views it."""

    def populate(self, mapping: Any, offset: int, nbytes: int) -> None:
        """Map `nbytes` of `mapping` from `offset` in now."""


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
        data = _raw(joined(values))
        dtype, size, shapes = _row_shapes(values)
        heads: dict[tuple[int, ...], bytes] = {}
        out = []
        start = 0
        for shape, numel in shapes:
            head = heads.get(shape)
            if head is None:
                head = heads[shape] = _header(dtype, shape)
            end = start + numel * size
            out.append(head + data[start:end])
            start = end
        return out
    return _object_cells(col.value)


def _object_cells(values: Sequence[Any]) -> list[bytes]:
    """The cells of a column of objects, each distinct object encoded once: a source repeats each
    prompt's objects n times (the addition task's 128 rows of 16 prompts: their extra_info
    dicts took 0.37 ms, now 0.03). The list holds every value while it runs, so no two share an ``id``."""
    done: dict[int, bytes] = {}
    out = []
    for v in values:
        cell = done.get(id(v))
        if cell is None:
            cell = done[id(v)] = _object(v)
        out.append(cell)
    return out


def write(col: _Column, buffer: Any, offset: int) -> None:
    """Copy a tensor column's rows, one after another, into writable `buffer` at `offset`: a put
    sends the cells first and copies while the storage unit stores them (`rlgraph.runtime.dataplane.wire.Wire.put`).

    A dense column in CPU memory (and a ragged one kept as `Rows`, by its flat tensor) is one C
    ``memmove``, shared with a second thread from `SHARED_COPY_BYTES` (`_Copier`); one on a GPU is one
    ``copy_``. The rows of any other ragged column are joined by one ``torch.cat`` into the buffer (a
    numpy copy per row cost ~7 us a row: 7.4 ms for 1,024 rows against 1.5 ms), on one torch thread:
    its OpenMP threads spin for a while after a parallel copy, taking the CPU from the storage unit
    (on 2 cores a put's round trip took 2-4 ms longer)."""
    rows = col.value
    if col.kind == "dense" or type(rows) is Rows and rows.flat is not None:  # a Rows: its flat tensor, as dense
        t: torch.Tensor = (rows if col.kind == "dense" else rows.flat).detach()
        count = _nbytes(t)
        if not count:
            return
        dest = (ctypes.c_char * count).from_buffer(buffer, offset)  # checks the bounds; an export while it lives
        # the bytes as they lie: not a lazily conjugated or negated view (copy_ resolves those)
        if type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg():
            if count >= SHARED_COPY_BYTES:
                _copier().copy(ctypes.addressof(dest), t.data_ptr(), count)
            else:
                ctypes.memmove(dest, t.data_ptr(), count)
            return
        with torch.no_grad(), _one_thread():
            torch.frombuffer(dest, dtype=torch.uint8).view(t.dtype).copy_(t.reshape(-1))
        return
    values: list[torch.Tensor] = col.value
    count = sum(v.numel() for v in values)
    if not count:
        return
    parts = values if all(v.dim() == 1 for v in values) else [v.reshape(-1) for v in values]
    if any(v.device.type != "cpu" for v in values):
        parts = [p.cpu() for p in parts]
    dest = torch.frombuffer(buffer, dtype=torch.uint8, count=count * values[0].element_size(), offset=offset)
    with torch.no_grad(), _one_thread():
        torch.cat(parts, out=dest.view(values[0].dtype))


SHARED_COPY_BYTES = 4 << 20  # a copy this large is shared with a second thread (`_Copier`)
_CHUNK = 1 << 20
_COPY_WAIT_S = 60.0  # a copy's wait for its other thread's last chunk (a chunk takes ~0.1 ms)


class _Copy:
    """One copy cut into chunks that the threads sharing it take in turn (`_Copier`)."""

    def __init__(self, dest: int, src: int, count: int) -> None:
        self.dest, self.src, self.count = dest, src, count
        self.chunks = -(-count // _CHUNK)
        self._next = itertools.count()  # taken from by both threads: ``next`` on it is atomic in CPython
        self._lock = threading.Lock()
        self._copied = 0
        self.done = threading.Event()

    def work(self) -> None:
        """Copy chunks until none is left to take."""
        while True:
            i = next(self._next)
            if i >= self.chunks:
                return
            start = i * _CHUNK
            ctypes.memmove(self.dest + start, self.src + start, min(_CHUNK, self.count - start))  # the GIL let go
            with self._lock:
                self._copied += 1
                if self._copied == self.chunks:
                    self.done.set()


class _Copier:
    """A second thread for large copies (`write`). A put's copy into its shared-memory segment is
    bound by memory, and one thread did not reach what two do: 16.8 MB took 1.8-1.9 ms on one thread
    against 1.3-1.4 ms on two, while the storage unit, which has already been sent the put's request,
    stores it on the same cores (over a link its thread is done in ~0.1 ms; over ZMQ's sockets it took
    the second core from the copy and answered 0.4 ms late). The calling thread copies too, so a
    second thread that gets no core (the other core busy) costs the copy nothing: the calling thread
    takes every chunk. A copy waits for the other thread only for the chunk it is copying."""

    def __init__(self) -> None:
        self._copies: queue.SimpleQueue[_Copy] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rlgraph-copy", daemon=True)
        self._thread.start()

    def copy(self, dest: int, src: int, count: int) -> None:
        job = _Copy(dest, src, count)
        self._copies.put(job)
        job.work()
        if not job.done.wait(_COPY_WAIT_S):
            raise DataPlaneError(f"a copy of {count} bytes into shared memory waited {_COPY_WAIT_S:.0f}s for its "
                                 f"second thread's last chunk")

    def _run(self) -> None:
        while True:
            self._copies.get().work()


_the_copier: _Copier | None = None
_copier_lock = threading.Lock()


def _forked() -> None:
    """A forked child starts its own copier (the parent's thread is not in it) and lock (one a
    thread of the parent held at the fork would never be let go)."""
    global _the_copier, _copier_lock
    _the_copier, _copier_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def _copier() -> _Copier:
    global _the_copier
    if _the_copier is None:
        with _copier_lock:
            if _the_copier is None:
                _the_copier = _Copier()
    return _the_copier


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread inside, the calling thread's number given back after. torch keeps the number a
    thread was given for its later threads' first parallel op too, so another thread starting its
    first parallel op inside this window would start with one thread."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


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
    dtype, size, shapes = _row_shapes(col.value)
    heads: dict[tuple[int, ...], bytes] = {}
    out = []
    for shape, numel in shapes:
        head = heads.get(shape)
        if head is None:
            head = heads[shape] = _header(dtype, shape, b"m")
        out.append(head + _OFFSET.pack(offset) + tail)
        offset += numel * size
    return out


def _row_shapes(values: Sequence[torch.Tensor]) -> tuple[torch.dtype, int, list[tuple[tuple[int, ...], int]]]:
    """A ragged column's dtype, element size and each row's (shape, elements): a `Rows`'s from its flat
    tensor and lengths, without making its row views; the rows share one dtype (`base._normalize`)."""
    if type(values) is Rows and values.flat is not None:
        return values.flat.dtype, values.flat.element_size(), [((n,), n) for n in values.lengths]
    return values[0].dtype, values[0].element_size(), [(tuple(v.shape), v.numel()) for v in values]


def _object(v: Any) -> bytes:
    if type(v) is str:
        return b"s" + v.encode()
    if type(v) is bytes:
        return b"b" + v
    try:
        return b"j" + _JSON_ENCODER.encode(v).encode()
    except (TypeError, ValueError) as e:
        raise DataPlaneError(f"a {type(v).__name__} value cannot go through the data plane ({e}); columns of "
                             f"objects hold strings, bytes, numbers, booleans, None and lists and dicts of them") from None


def any_shared(cells: Sequence[Any]) -> bool:
    """Whether some of a column's cells are shared rows (descriptors, `shared`). Their first bytes
    read in one pass (a test per cell cost ~5 us per 128 rows of a column)."""
    try:
        return _SHARED in bytes(map(_FIRST, cells))
    except IndexError:  # an empty cell among them
        return any(c[0] == _SHARED for c in cells if c)


_FIRST = operator.itemgetter(0)


def payload_nbytes(cells: Sequence[bytes]) -> list[int]:
    """Bytes of each cell (header included: a few bytes a row)."""
    return [len(c) for c in cells]


def _objects(cells: Sequence[Any]) -> list[Any]:
    tags = {c[0] for c in cells}
    if tags == {_JSON}:  # one parse of the rows as one JSON array, not one json.loads a row (~7 us each)
        return json.loads(b"[" + b",".join(memoryview(c)[1:] for c in cells) + b"]")
    if tags == {_STR}:
        return [str(memoryview(c)[1:], "utf-8") for c in cells]
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
    kinds = set(map(type, cells))
    if not kinds <= {bytes, bytearray, memoryview}:
        foreign = next(c for c in cells if type(c) not in (bytes, bytearray, memoryview))
        raise DataPlaneError(f"the data plane returned a cell of type {type(foreign).__name__} where rlgraph's "
                             f"encoding was expected; a process other than rlgraph's wrote this column")
    if cells[0][0] not in (_TENSOR, _SHARED):
        return _objects(cells)
    if cells[0][0] == _TENSOR:
        parsed = _dense_rows(cells)
        if parsed is None:
            parsed = _ragged_rows(cells)
        if parsed is not None:
            return parsed
    if cells[0][0] == _SHARED and segments is not None:
        table = _shared_table(cells)
        if table is not None:  # one dtype and one number of dimensions: parsed as one array
            code, shapes, runs = table
            return _mapped(code, shapes, runs, segments)
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
            return _mapped(heads[0][0], [shape for _, shape in heads], _runs(places), segments)
        leases: dict[str, Any] = {}  # rows put as bytes among them: the shared ones are copied out
        bodies = [b if p is None else _read(_lease(leases, p[0], segments), p[1], p[2], segments)
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


def _dense_rows(cells: Sequence[Any]) -> torch.Tensor | None:
    """The rows of cells that all carry one header (tensor rows of one dtype and shape: a dense
    column), as one tensor, parsed and copied at once (a cell at a time cost ~2 us a row); else None."""
    first = cells[0]
    size = len(first)
    if len(set(map(len, cells))) != 1:
        return None
    _, code, ndim = _HEAD.unpack_from(first)
    if ndim >= len(_SHAPES) or code >= len(_DTYPES):
        return None
    head = _HEAD.size + 4 * ndim
    table = np.frombuffer(b"".join(cells), dtype=np.uint8).reshape(len(cells), size)
    if not (table[:, :head] == table[0, :head]).all():
        return None
    shape = _SHAPES[ndim].unpack_from(first, _HEAD.size)
    dtype = _DTYPES[code]
    if (size - head) != _numel(shape) * dtype.itemsize:
        return None
    if size == head:  # rows of no elements
        return torch.empty(len(cells), *shape, dtype=dtype)
    flat = torch.from_numpy(table[:, head:].copy().reshape(-1))  # the one copy, writable and 1-D
    return flat.view(dtype).view(len(cells), *shape)


def _ragged_rows(cells: Sequence[Any]) -> list[torch.Tensor] | None:
    """Tensor rows of one dtype and number of dimensions but of several shapes (a ragged column),
    parsed at once: their bodies copied out in one masked copy, then split into per-row views
    (a cell at a time cost ~5 us a row); None when the cells are not all such rows."""
    n = len(cells)
    _, code, ndim = _HEAD.unpack_from(cells[0])
    if ndim >= len(_SHAPES) or code >= len(_DTYPES) or n < 2:
        return None
    head = _HEAD.size + 4 * ndim
    lengths = np.fromiter(map(len, cells), dtype=np.int64, count=n)
    if int(lengths.min()) < head:
        return None
    joined = np.frombuffer(b"".join(cells), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    heads = joined[starts[:, None] + np.arange(head)]  # [rows, header bytes]
    if not (heads[:, :_HEAD.size] == heads[0, :_HEAD.size]).all():
        return None
    shapes = heads[:, _HEAD.size:].copy().view("<u4").reshape(n, ndim).astype(np.int64)
    dtype = _DTYPES[code]
    numels = shapes.prod(axis=1)
    if not (numels * dtype.itemsize == lengths - head).all():
        return None
    keep = np.ones(joined.size, dtype=bool)
    keep[(starts[:, None] + np.arange(head)).ravel()] = False
    body = joined[keep]  # the one copy: every body, in order
    flat = torch.from_numpy(body).view(dtype) if body.size else torch.empty(0, dtype=dtype)
    if ndim == 1:
        return Rows(flat, numels.tolist())
    parts = torch.split(flat, numels.tolist())
    return [p.view(*shape) for p, shape in zip(parts, shapes.tolist())]


def _shared_table(cells: Sequence[Any]) -> tuple[int, np.ndarray, Sequence[tuple[str, int, int, int]]] | None:
    """(dtype code, row shapes as an array, runs) when every cell is a shared row of one dtype and
    number of dimensions, with names of one length (what one put, or several puts of one writer,
    write); else None. Parsed on all cells at once, as one array. A run: (segment, offset, bytes,
    rows) of rows that lie one after another in one segment."""
    first = cells[0]
    size = len(first)
    if len(set(map(len, cells))) != 1:
        return None
    tag, code, ndim = _HEAD.unpack_from(first)
    if tag != b"m" or ndim >= len(_SHAPES) or code >= len(_DTYPES):
        return None
    joined = b"".join(cells)
    known = _TABLES.get(joined)
    if known is not None:
        return known
    at = _HEAD.size + 4 * ndim  # where the offset starts
    table = np.frombuffer(joined, dtype=np.uint8).reshape(len(cells), size)
    if not (table[:, :_HEAD.size] == table[0, :_HEAD.size]).all():
        return None
    shapes = table[:, _HEAD.size:at].copy().view("<u4").reshape(len(cells), ndim).astype(np.int64)
    offsets = table[:, at:at + _OFFSET.size].copy().view("<u8").ravel().astype(np.int64)
    nbytes = shapes.prod(axis=1) * _DTYPES[code].itemsize
    names = table[:, at + _OFFSET.size:]
    # a run ends where the next row is in another segment or not right after it
    ends = (offsets[1:] != offsets[:-1] + nbytes[:-1]) | (names[1:] != names[:-1]).any(axis=1)
    starts = [0, *(np.flatnonzero(ends) + 1).tolist(), len(cells)]
    runs = []
    for a, b in zip(starts, starts[1:]):
        runs.append((bytes(names[a]).decode(), int(offsets[a]), int(offsets[b - 1] + nbytes[b - 1] - offsets[a]), b - a))
    shapes.setflags(write=False)  # kept, and handed to every get of the same cells
    parsed = code, shapes, tuple(runs)
    if len(joined) > _TABLE_MAX_BYTES:
        return parsed
    with _TABLES_LOCK:
        _TABLES[joined] = parsed
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return parsed


# the parsed tables of the last gets' shared cells, by their bytes: a writer that reuses a segment
# sends the same cells for a put of the same layout (`shm._cells`), so a reader's next get of that
# column finds them here (1,024 rows: 0.3 ms to parse, 0.025 ms to look up); at most this many,
# each of at most this many bytes of cells (16,384 rows of a 2-D column)
_TABLES_KEPT = 16
_TABLE_MAX_BYTES = 1 << 20
_TABLES: "collections.OrderedDict[bytes, tuple[int, np.ndarray, Sequence[tuple[str, int, int, int]]]]" = \
    collections.OrderedDict()
_TABLES_LOCK = threading.Lock()


def _runs(places: list[Any]) -> list[tuple[str, int, int, int]]:
    """Shared rows' (segment, offset, bytes) grouped into runs of rows adjacent in one segment:
    (segment, offset, bytes, rows)."""
    runs: list[list[Any]] = []
    for name, offset, n in places:
        last = runs[-1] if runs else None
        if last is not None and last[0] == name and last[1] + last[2] == offset:
            last[2] += n
            last[3] += 1
        else:
            runs.append([name, offset, n, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _read(mapping: Any, offset: int, nbytes: int, segments: Segments) -> memoryview:
    """`nbytes` of a leased mapping from `offset`, mapped in (`Segments.populate`) before they are read."""
    segments.populate(mapping, offset, nbytes)
    return memoryview(mapping)[offset:offset + nbytes]


def _lease(leases: dict[str, Any], name: str, segments: Segments) -> Any:
    mapping = leases.get(name)
    if mapping is None:
        mapping = leases[name] = segments.lease(name)
    return mapping


def _mapped(code: int, shapes: Any, runs: Sequence[tuple[str, int, int, int]], segments: Segments) -> ColumnData:
    """A column over the segments that hold its rows (one mapping a segment, `Segments.lease`): no
    copy, but for a dense column whose rows lie in several runs (joined into one tensor)."""
    dtype = _DTYPES[code]
    leases: dict[str, Any] = {}
    flats = []
    for name, offset, n, _ in runs:
        mapping = _lease(leases, name, segments)  # a missing segment is an error even for empty rows
        if n:
            segments.populate(mapping, offset, n)
            flats.append(torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=offset).view(dtype))
        else:
            flats.append(torch.empty(0, dtype=dtype))
    rows = sum(r[3] for r in runs)
    if isinstance(shapes, np.ndarray):
        dense = bool((shapes == shapes[0]).all())
        first = tuple(shapes[0].tolist())
    else:
        dense = len(set(shapes)) == 1
        first = shapes[0]
    if dense:
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        return flat.view(rows, *first)
    shapes = shapes.tolist() if isinstance(shapes, np.ndarray) else shapes
    if len(flats) == 1 and all(len(shape) == 1 for shape in shapes):  # one run of 1-D rows: views of it
        return Rows(flats[0], [shape[0] for shape in shapes])
    out: list[torch.Tensor] = []
    at = 0
    for flat, (_, _, _, k) in zip(flats, runs):
        part = shapes[at:at + k]
        at += k
        if all(len(shape) == 1 for shape in part):  # rows of one dimension: split's parts as they are
            out.extend(torch.split(flat, [shape[0] for shape in part]))
        else:
            out.extend(p.view(*shape) for p, shape in zip(torch.split(flat, [_numel(tuple(s)) for s in part]), part))
    return out


def _shaped(flat: torch.Tensor, heads: list[tuple[int, tuple[int, ...]]], rows: int) -> ColumnData:
    """Rows of one dtype from their bytes (uint8, in order): dense when they agree in shape."""
    dtype = _DTYPES[heads[0][0]]
    flat = flat.view(dtype) if flat.numel() else torch.empty(0, dtype=dtype)
    shapes = {shape for _, shape in heads}
    if len(shapes) == 1:
        return flat.view(rows, *heads[0][1])
    if all(len(shape) == 1 for shape in shapes):  # rows of one dimension: views of the flat tensor
        return Rows(flat, [shape[0] for _, shape in heads])
    sizes = [_numel(shape) for _, shape in heads]
    return [part.view(shape) for part, (_, shape) in zip(torch.split(flat, sizes), heads)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
