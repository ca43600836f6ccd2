"""Item 4: data-plane put and get: TransferQueue, the Ray-object-store plane, and memcpy.

From the benchmark's process (a client like any worker), for dense and ragged float32 columns
of several sizes: put then get of the whole column, `repeats` times on a fresh partition each;
throughput is column bytes / median time, latency the median time of one call. The memcpy
row copies the same tensor (or the same per-row tensors) in memory: the ceiling.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

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


def time_memcpy(col: Any, repeats: int) -> float:
    """Copy into already allocated memory (a fresh allocation would add page faults)."""
    dst = col.clone() if isinstance(col, torch.Tensor) else [c.clone() for c in col]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        if isinstance(col, torch.Tensor):
            dst.copy_(col)
        else:
            for d, c in zip(dst, col):
                d.copy_(c)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    sizes = [(1, 16), (64, 256), (256, 2048)] if quick else [(1, 16), (64, 256), (256, 2048), (1024, 4096)]
    repeats = 2 if quick else 5
    planes = {"TransferQueue": common.plane("transferqueue"), "Ray object store": common.plane("ray")}
    t = common.Table(["column", "rows x mean width", "bytes", "backend", "put MB/s", "get MB/s", "put ms", "get ms"])
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for kind in ("dense", "ragged"):
        for rows, width in sizes:
            col = make_column(kind, rows, width)
            b = nbytes(col)
            for name, plane in planes.items():
                put, get = time_plane(plane, col, rows, repeats)
                t.add(kind, f"{rows} x {width}", b, name, b / put / 1e6, b / get / 1e6, 1000 * put, 1000 * get)
                summary.setdefault((kind, b), {})[name] = b / get / 1e6
            cp = time_memcpy(col, repeats * 4)
            t.add(kind, f"{rows} x {width}", b, "memcpy", b / cp / 1e6, b / cp / 1e6, 1000 * cp, 1000 * cp)
            summary[(kind, b)]["memcpy"] = b / cp / 1e6
            print(f"  {kind} {rows}x{width}: {summary[(kind, b)]}", flush=True)
    t.print()
    big = max(summary)  # the largest dense or ragged column measured
    s = summary[big]
    intro = """
Put then get of one float32 column for all rows of a fresh partition, from the benchmark's own
process (a data-plane client like any worker; the planes' storage runs in Ray actors on the same
machine). Dense: a `[rows, width]` tensor; ragged: one tensor per row, log-normal lengths with mean
`width`. Median of the repeats after one warm-up round; MB = 10^6 bytes. memcpy: `copy_()` of
the same tensor(s) into memory allocated beforehand (put and get columns show the same copy).
"""
    notes = (f"Largest {big[0]} column ({big[1] / 1e6:.1f} MB), get throughput: TransferQueue "
             f"{s['TransferQueue']:.0f} MB/s, Ray object store {s['Ray object store']:.0f} MB/s, memcpy "
             f"{s['memcpy']:.0f} MB/s. Every put or get has a fixed cost of a few milliseconds (the 1-row row), "
             f"so ops should move many rows per call.")
    if any(math.isnan(v) for v in s.values()):  # pragma: no cover
        notes = ""
    return common.Section("dataplane", "4. Data plane: put and get", intro, [t], notes,
                          common.command_line(argv if argv is not None else ["dataplane"] + (["--quick"] if quick else [])))
