"""The start-up heap kept out of Python's garbage collector: `freeze` once a process is set up.

Every process of a run (the driver, each worker, the data source, TransferQueue's controller and
storage units) imports torch, and most transformers and Ray: about 400,000 Python objects that live
until the process ends. Python's cyclic collector scans all of them in each full (oldest-generation)
collection, which it starts whenever the objects that survived younger collections reach a quarter
of that number: 170 ms a collection in a worker on this project's 2-core test machine. A step that
makes many objects per row (large batches of per-row tensors, rows of TransferQueue's metadata)
reaches that count every few steps, so a step now and then took 170 ms longer in one process,
more often the larger the batch: part of what made the runtime's cost per row grow with the rows
(docs/performance.md, section 12).

`freeze` moves everything alive at the end of start-up into Python's permanent generation
(``gc.freeze``), which no collection scans; objects made later are collected as before, and objects
freed by their reference count (nearly all) are freed as before. No collection runs first: it would
cost each process the 170 ms, at a start-up bound by the CPU; the unreachable cycles start-up left
(a few MB) stay. vLLM's engine and Ray Serve's replicas freeze the same way after their start.

``RLGRAPH_GC_FREEZE=0`` (in the environment of ``rlgraph run``; the workers of a Ray that rlgraph
starts inherit it) leaves the collector as Python has it.
"""

from __future__ import annotations

import gc
import os

__all__ = ["SWITCH", "freeze"]

SWITCH = "RLGRAPH_GC_FREEZE"  # "0": leave Python's collector as it is


def freeze() -> bool:
    """Keep every object alive now out of later collections. Call it when a
    process has finished starting (imports done, models loaded); calling it again later freezes
    what was made since. Returns whether it froze (off with ``RLGRAPH_GC_FREEZE=0``)."""
    if os.environ.get(SWITCH, "1") == "0":
        return False
    gc.freeze()
    return True
