"""Item 4: data-plane put and get: TransferQueue, the Ray-object-store plane, and memcpy.

From the benchmark's process (a client like any worker), for dense and ragged float32 columns
of several sizes: put then get of the whole column, `repeats` times on a fresh partition each;
throughput is column bytes / median time, latency the median time of one call. The memcpy
row copies the same tensor (or the same per-row tensors) in memory with libc's ``memmove`` (its
memcpy's code), one call a tensor on one thread: the plain memcpy the issue holds the planes against. torch's
``copy_`` of the same tensors, which splits a large copy over the process's torch threads (two
here), is a row of its own.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks import common


def make_column(kind: str, rows: int, width: int) -> Any:
    g = torch.Generator().manual_seed(rows * 31 + width)
    if kind == "dense":
        return torch.randn(rows, width, generator=g)
    # ragged: log-normal row lengths with the same mean as `width`
    lens = torch.exp(torch.randn(rows, generator=g) * 0.75).clamp(max=8.0)
    lens = (lens / lens.mean() * width).round().clamp(min=1).long().tolist()
    return [torch.randn(n, generator=g) for n in lens]


def nbytes(col: Any) -> int:
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    return sum(c.numel() * c.element_size() for c in col)


def time_plane(plane: Any, col: Any, rows: int, repeats: int) -> tuple[float, float]:
    puts, gets = [], []
    for k in range(repeats + 1):
        part = f"bench_{rows}_{k}_{time.time_ns()}"
        plane.create_partition(part, rows)
        try:
            t0 = time.perf_counter()
            plane.put(part, list(range(rows)), {"x": col})
            t1 = time.perf_counter()
            out = plane.get(part, tuple(range(rows)), ["x"])
            t2 = time.perf_counter()
        finally:
            plane.clear(part)
        assert len(out["x"]) == rows
        if k:  # the first round warms connections up
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    return statistics.median(puts), statistics.median(gets)


def copy_plain(dst: Any, col: Any) -> None:
    """A plain memcpy of `col` (a tensor, or a list of per-row tensors, contiguous) into `dst`: one
    libc ``memmove`` a tensor (ctypes'; glibc's memmove and memcpy are one routine on x86-64), on the
    calling thread."""
    if isinstance(col, torch.Tensor):
        ctypes.memmove(dst.data_ptr(), col.data_ptr(), nbytes(col))
        return
    for d, c in zip(dst, col):
        ctypes.memmove(d.data_ptr(), c.data_ptr(), c.numel() * c.element_size())


def torch_row() -> str:
    """The name of the row of torch's ``copy_``, with the threads it splits a large copy over."""
    n = torch.get_num_threads()
    return f"torch copy_, {n} thread{'s' if n > 1 else ''}"


def copy_torch(dst: Any, col: Any) -> None:
    """torch's ``copy_``: a large tensor's copy split over the process's torch threads."""
    if isinstance(col, torch.Tensor):
        dst.copy_(col)
        return
    for d, c in zip(dst, col):
        d.copy_(c)


def time_memcpy(col: Any, repeats: int, cold: bool = False, copy: Callable[[Any, Any], None] = copy_plain) -> float:
    """Copy into already allocated memory (a fresh allocation would add page faults): the same
    destination each time, or with `cold`, destinations in turn that together exceed the last-level
    cache twice over, so that each copy writes memory the cache does not hold, as a put's copy into a
    segment does (the segment was last written a step before)."""
    count = 1 + (-(-2 * _cache_bytes() // max(nbytes(col), 1)) if cold else 0)
    dsts = [col.clone() if isinstance(col, torch.Tensor) else [c.clone() for c in col] for _ in range(count)]
    times = []
    for k in range(repeats + count):
        dst = dsts[k % count]
        t0 = time.perf_counter()
        copy(dst, col)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[count:])


@functools.cache
def _cache_bytes() -> int:
    """The last-level cache's size (Linux's sysfs), else 32 MiB."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


class _BytesOnly:
    """The TransferQueue plane with its shared memory switched off for each call: the same plane,
    client and storage units, so the two rows differ only in where the large columns' bytes go."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane

    def _call(self, name: str, *args: Any) -> Any:
        segments, self.plane._segments = self.plane._segments, None
        try:
            return getattr(self.plane, name)(*args)
        finally:
            self.plane._segments = segments

    def create_partition(self, *args: Any) -> None:
        self.plane.create_partition(*args)

    def clear(self, partition: str) -> None:
        self.plane.clear(partition)

    def put(self, *args: Any) -> None:
        self._call("put", *args)

    def get(self, *args: Any) -> Any:
        return self._call("get", *args)


SHARED = "TransferQueue + shared memory"
BYTES = "TransferQueue, bytes only"
RAY = "Ray object store"
MEMCPY = "memcpy"
COLD = "memcpy into memory not in the cache"
FRESH = "memcpy into new memory"


def time_fresh_copy(col: Any, repeats: int) -> float:
    """Copy into memory allocated for the copy, as a get that returns new tensors must: on a VM the
    first touch of fresh pages can cost more than the copy itself."""
    times = []
    out: Any = None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        # the last copy is still held while the next is made, as `time_plane` holds the last get's
        new = torch.empty_like(col) if isinstance(col, torch.Tensor) else [torch.empty_like(c) for c in col]
        copy_plain(new, col)
        times.append(time.perf_counter() - t0)
        out = new
    del out
    return statistics.median(times[1:])


def _against(found: dict[str, tuple[float, float]], backends: list[str], ref: str) -> str:
    """Each backend's put and get as a share of copy `ref`'s speed."""
    return "; ".join(f"{name} put {found[ref][0] / found[name][0]:.1%} and get {found[ref][0] / found[name][1]:.1%}"
                     for name in backends)


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    sizes = [(1, 16), (64, 256), (256, 2048)] if quick else [(1, 16), (64, 256), (256, 2048), (1024, 4096)]
    repeats = 2 if quick else 5
    tq = common.plane("transferqueue")
    planes = {BYTES: _BytesOnly(tq), RAY: common.plane("ray")}
    if tq.uses_shared_memory():  # one node with /dev/shm (else the shared row would repeat the bytes row)
        planes = {SHARED: tq, **planes}
    t = common.Table(["column", "rows x mean width", "bytes", "backend", "put MB/s", "get MB/s", "put ms", "get ms",
                      "put / memcpy", "get / memcpy"])
    summary: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    for kind in ("dense", "ragged"):
        for rows, width in sizes:
            col = make_column(kind, rows, width)
            b = nbytes(col)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in planes}
            copies, torch_copies, cold_copies = [], [], []
            for _ in range(3):  # the backends and the copies alternate: the machine's noise falls on all of them
                for name, plane in planes.items():
                    # small columns take a few ms a round: more rounds for a steadier median of the fixed cost
                    rounds = repeats if b >= 1_000_000 else 4 * repeats
                    times[name].append(time_plane(plane, col, rows, rounds))
                copies.append(time_memcpy(col, repeats * 4))
                torch_copies.append(time_memcpy(col, repeats * 4, copy=copy_torch))
                if b >= 1_000_000:
                    cold_copies.append(time_memcpy(col, repeats * 2, cold=True))
            found = {name: (statistics.median(x[0] for x in times[name]), statistics.median(x[1] for x in times[name]))
                     for name in planes}
            cp = statistics.median(copies)
            found[MEMCPY] = (cp, cp)
            found[torch_row()] = (statistics.median(torch_copies),) * 2
            if cold_copies:
                found[COLD] = (statistics.median(cold_copies),) * 2
            found[FRESH] = (time_fresh_copy(col, repeats),) * 2
            for name, (put, get) in found.items():
                ratios = ("", "") if name == MEMCPY else (f"{cp / put:.1%}", f"{cp / get:.1%}")
                t.add(kind, f"{rows} x {width}", b, name, b / put / 1e6, b / get / 1e6, 1000 * put, 1000 * get, *ratios)
            summary[(kind, b)] = found
            print(f"  {kind} {rows}x{width}: " + ", ".join(f"{k} put {v[0] * 1e3:.2f} ms get {v[1] * 1e3:.2f} ms"
                                                         for k, v in found.items()), flush=True)
    t.print()
    first = next(iter(planes))
    intro = f"""
Put then get of one float32 column for all rows of a fresh partition, from the benchmark's own
process (a data-plane client like any worker; the planes' storage runs in Ray actors on the same
machine). Dense: a `[rows, width]` tensor; ragged: one tensor per row, log-normal lengths with mean
`width`. Median over the repeats after one warm-up round (columns under 1 MB: {4 * repeats} rounds a turn,
larger ones {repeats}), the backends taking turns three times; MB = 10^6
bytes. memcpy: a plain memcpy of the same tensor(s) into memory allocated beforehand (libc's
`memmove`, glibc's memcpy code, one call a tensor, on one thread; put and get columns show the same copy), timed in each
turn between the backends'; "/ memcpy" is memcpy's time over the backend's. "{torch_row()}" copies
the same way with torch's `copy_()`, which splits a large copy over the process's torch threads
(a put's copy into its segment is shared by two threads too, from 4 MiB). "{COLD}" (columns of 1 MB
or more) copies into destinations in turn that together exceed twice the last-level cache
({_cache_bytes() >> 20} MiB here), so that each copy writes memory the cache does not hold, as a put's copy
into its segment does; memcpy into the same destination finds both tensors in the cache when they
fit (16.8 MB twice: 33.6 MB). "{FRESH}" allocates the destination each time, holding the last copy
while it makes the next, as the get rows hold the last get: a get that returns new tensors must
write fresh memory, and on this machine (a VM) the first touch of a page the allocator has not
reused costs about 2.5 us, more than copying it.
{SHARED}: the default on one node, where tensor columns of at least 64 KiB go through `/dev/shm`
(`rlgraph.runtime.dataplane.shm`): a put writes them into a segment, a get maps it (no copy; the
time includes filling the mapping's page tables, about 1 ms for 16 MB here); {BYTES}: the same plane with that switched off
(`dataplane.shared_memory=false`, and what several nodes get).
"""
    one = summary[min(k for k in summary if k[0] == "dense")][first]
    notes = [f"Fixed cost of a put plus a get (the 1-row dense column, {first}): {1e3 * sum(one):.2f} ms "
             f"(target < 1 ms)."]
    for kind in ("dense", "ragged"):
        big = max(k for k in summary if k[0] == kind)
        found = summary[big]
        vs = functools.partial(_against, found, [name for name in found if name in planes])
        notes.append(f"Largest {kind} column ({big[1] / 1e6:.1f} MB): {vs(MEMCPY)} of memcpy (target 25%); "
                     f"{FRESH} {found[MEMCPY][0] / found[FRESH][0]:.1%}; against {torch_row()}: "
                     f"{vs(torch_row())}" + (f"; against {COLD}: {vs(COLD)}" if COLD in found else "") + ".")
    return common.Section("dataplane", "4. Data plane: put and get", intro, [t], " ".join(notes),
                          common.command_line(argv if argv is not None else ["dataplane"] + (["--quick"] if quick else [])))
