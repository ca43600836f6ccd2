"""glibc's malloc, set for a worker's tensors (``trainer.malloc_keep_mb``).

PyTorch's CPU tensors come from malloc. By default glibc serves a block of 128 KiB or more with a
fresh ``mmap`` (a threshold it raises only towards the size of blocks freed lately) and gives the
top of its heap back to the kernel once more than twice that threshold is free. A forward pass
allocates and frees activations of that size many times, so each pass wrote pages new to the
process, and the first write to a page costs a page fault: about 2.5 us a page on this machine (a
VM), more than copying the page. A policy worker of `examples/grpo.py` took ~9,000 faults a
second; with the settings here, ~10. The tiny model's forward of 128 rows took 11.0-11.8 ms
against 6.1-7.7 ms (benchmarks/findings.md, "Page faults in a worker's forward passes").

`keep_freed` raises the mmap threshold to 32 MiB (glibc's own ceiling for its dynamic threshold)
and keeps up to `mb` MiB free at the heap's top: a worker's memory stays at its peak (as a caching
allocator's does, CUDA's among them) instead of going back to the kernel between passes. Blocks of
32 MiB or more are still mapped and unmapped each time.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def keep_freed(mb: int) -> bool:
    """Keep up to `mb` MiB of freed memory in this process for reuse, and serve blocks under 32 MiB
    from the heap (see the module). 0 leaves glibc's defaults. False where it could not be set: not
    glibc (musl, macOS), which then allocates as it does by default."""
    if mb <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
        ctypes.CDLL(None).gnu_get_libc_version  # glibc's: musl has a mallopt that does nothing
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    keep = min(mb << 20, 2**31 - 1)
    return mallopt(_M_MMAP_THRESHOLD, min(MMAP_THRESHOLD, keep)) == 1 and mallopt(_M_TRIM_THRESHOLD, keep) == 1
