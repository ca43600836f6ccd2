"""Shared memory for large tensor columns on one machine: the bytes skip TransferQueue's sockets.

Through TransferQueue a column's bytes are copied into a message, sent to a storage unit (another
process) that keeps them, and sent again to whoever gets them: 540 MB/s for a 16 MB column where
memcpy does 20 GB/s. When every process of the run is on one machine, `Segments` writes a put's
large tensor columns into a shared-memory segment (a file in ``/dev/shm``) instead, and the cells
TransferQueue stores for them are descriptors (`cells.shared`: dtype, shape, segment, offset), so
a put or a get is still one round trip to a storage unit, with a few dozen bytes a row in it.

- **What goes there.** The tensor columns of one put whose bytes reach `MIN_BYTES` (64 KiB) and
  whose rows are at least `MIN_ROW_BYTES` each (a row's descriptor is about 60 bytes), laid out one after another (64-byte aligned) in
  one segment. Objects and small columns travel as bytes, as before.
- **The copy overlaps the request.** A put takes its room first (`Segments.place`), sends the
  descriptors, and copies the bytes while the storage unit stores them (`Placed.write`, run by
  `wire.Wire.put` between sending and waiting): 16 MB, 2.6 -> 2.2 ms a put. No reader learns of
  the rows before the put returns, after both. A copy that fails fails the put; its segment stays
  with its partition (its descriptors may be stored) until the partition is cleared.
- **Reuse.** A fresh segment's pages are faulted in as it is written, which on a VM costs more
  than the copy (16 MB: ~10 ms against ~1 ms). So the writer keeps its segments mapped: when the
  driver clears a partition (`forget`, which the driver sends every worker after the partition's
  last call has returned; after a failed step, once its other calls have ended,
  `rlgraph.runtime.fleet.Fleet.fence`), the segments of that partition's puts go to a free list
  and later puts write into them again, each only once no reader holds it (below). At most
  `KEEP_FREE` segments are kept free; older ones are removed. A reused segment also keeps the cells
  of its last put's dense columns: a put of the same layout (offset, dtype, shape) sends them again
  rather than making 1,024 descriptors anew (16 MB: 2.1-2.4 -> 1.9-2.0 ms a put).
- **Reads map, they do not copy.** A get maps each segment it reads (`lease`: copy-on-write,
  ``MAP_PRIVATE``, its pages mapped in before the get returns, `populate`) and `cells.decode`
  hands the op tensors over that mapping: no copy, and no fresh pages to fault in (copying 16 MB
  into new memory cost ~10 ms here, mapping it ~1 ms). An op may write into what it got: the
  pages it writes become its own, the segment is untouched. It may also keep it: the mapping
  holds a shared ``flock`` on the segment's file until its last tensor is gone, and a writer
  reuses a free segment only when it can take that lock exclusively, else it makes a new one. A
  segment removed while a reader holds it keeps its memory until the reader lets go, as a copy
  would. Rows of one dense column from several segments (several puts) are copied into one
  tensor; ragged rows stay views, one per row.
- **Readers keep their mappings.** Mapping a segment's pages in again for every get cost most of
  a get (16 MB: 0.6-1.0 ms of about 2). So a reader keeps the mapping of each segment it reads
  (`_Kept`, at most `KEEP_MAPPED`) and the next get of that segment, typically the next step's
  once its writer has reused it, hands out tensors over the same mapping (`_Leased`, which holds
  that get's lock). The pages an op wrote into (its own copies) would show that op's bytes, so
  before a get returns, the reader asks the kernel which pages of the rows it read are still
  the segment's (``/proc/self/pagemap``: 0.15 ms for 16 MB), drops the others (``MADV_DONTNEED``:
  they map the segment's again) and maps in what is missing. A second get of a segment while an
  earlier one's tensors live maps its own, as before; so does every get where the pagemap cannot
  tell (checked once a process, `_pagemap_works`). A kept mapping of a segment its writer removed
  is let go at the reader's next get, or when a partition is cleared (`forget`).
- **Names and clean-up.** ``/dev/shm/rlgraph-<pid namespace>-<driver pid>-<plane token>-<writer
  pid>-<writer token>-<n>`` (the namespace: containers sharing ``/dev/shm`` may reuse pids). A
  writer removes its free segments when it closes; the driver removes every segment of its plane
  when the plane closes (`remove_all`), and, at start, those of drivers no longer running
  (`sweep`); the reaper removes a killed driver's (`rlgraph.runtime.reaper`).
- **Space.** A segment's pages are reserved when it is made (``posix_fallocate``): a full
  ``/dev/shm`` makes that put take the bytes path, instead of a SIGBUS at the first write.
- **One machine only.** The driver turns it on only when the Ray cluster has one node and the
  driver is on it (`TransferQueueConfig.shared_memory`, ``dataplane.shared_memory``); a descriptor
  read where its segment does not exist is a `DataPlaneError` naming the segment.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import re
import secrets
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rlgraph.runtime.dataplane import cells
from rlgraph.runtime.dataplane.base import DataPlaneError, _Column, _nbytes

__all__ = ["Segments", "Placed", "available", "populate", "MIN_BYTES", "MIN_ROW_BYTES", "KEEP_FREE", "KEEP_FREE_BYTES",
           "SHM_DIR", "driver_prefix", "namespace", "prefix_for", "remove_all", "sweep"]

SHM_DIR = "/dev/shm"
MIN_BYTES = 64 * 1024  # a put's tensor columns of at least this many bytes go to shared memory
KEEP_FREE = 16  # segments a writer keeps for reuse once their partition is cleared
MIN_ROW_BYTES = 256  # and rows of at least this many bytes (a row's descriptor is about 60)
KEEP_FREE_BYTES = 1 << 30  # and at most this many bytes of them
KEEP_MAPPED = 16  # segments a reader keeps mapped for its next gets
KEEP_MAPPED_BYTES = 1 << 30  # and at most this many bytes of them
_AROUND = 64 * 1024  # the kernel's fault-around: a read fault maps this much around it
ALIGN = 64
_NAME = re.compile(r"^rlgraph-([0-9a-f]+)-(\d+)-[0-9a-f]+-\d+-[0-9a-f]+-\d+$")


def available() -> bool:
    """Whether this machine has a shared-memory file system where rlgraph can write."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def namespace() -> str:
    """This machine's pid namespace, as a short token: containers that share ``/dev/shm`` (Docker's
    ``--ipc=host``) may each have a driver of the same pid, and one must never take the other's for
    dead or remove its segments."""
    try:
        ns = os.stat("/proc/self/ns/pid")
        return f"{ns.st_dev:x}{ns.st_ino:x}"
    except OSError:
        return "0"


def driver_prefix(driver_pid: int) -> str:
    """The name prefix of every segment of one driver's planes."""
    return f"rlgraph-{namespace()}-{driver_pid}"


def prefix_for(driver_pid: int, token: str) -> str:
    """The name prefix of the segments of one plane."""
    return f"{driver_prefix(driver_pid)}-{token}"


@dataclass
class _Segment:
    name: str
    buffer: mmap.mmap
    capacity: int
    fd: int  # the writer's own descriptor of the file: tells whether a reader still holds it (`_held`)
    # the cells of the dense columns its last put laid out, by (offset, dtype, shape): a reused segment's
    # next put of the same layout sends the same cells (1,024 rows: 0.14-0.24 ms to build again)
    cells: dict[tuple, list[bytes]] = field(default_factory=dict)


class Placed:
    """A put's large columns with their room in a segment (`Segments.place`): `cells` to send,
    `write` to copy their bytes in. Readers learn of the rows only once the put has returned, after
    both. A copy that fails fails the put; its segment stays with the partition until the partition
    is cleared (its cells may be stored already: no later put writes under them)."""

    def __init__(self, segment: _Segment, columns: dict[str, _Column], offsets: dict[str, int],
                 cells_: dict[str, list[bytes]]) -> None:
        self._segment, self._columns, self._offsets = segment, columns, offsets
        self.cells = cells_

    def write(self) -> None:
        buffer = self._segment.buffer
        # an export of the mapping while it is written: `close` cannot unmap it under the copy
        # (torch.frombuffer holds none), it leaves the mapping to the garbage collector instead
        with memoryview(buffer):
            for name, col in self._columns.items():
                cells.write(col, buffer, self._offsets[name])


def _cells(segment: _Segment, columns: dict[str, _Column], offsets: dict[str, int]) -> dict[str, list[bytes]]:
    """The cells of `columns` laid out in `segment` at `offsets`: a dense column's as the segment's last
    put of the same layout sent them (a cell holds only the dtype, the row shape, the segment and the
    row's offset), else made (`cells.shared`); the segment keeps this put's dense cells."""
    out, kept = {}, {}
    for name, col in columns.items():
        if col.kind != "dense":
            out[name] = cells.shared(col, segment.name, offsets[name])
            continue
        key = (offsets[name], col.value.dtype, tuple(col.value.shape))
        made = segment.cells.get(key)
        out[name] = kept[key] = made if made is not None else cells.shared(col, segment.name, offsets[name])
    segment.cells = kept
    return out


def _capacity(nbytes: int) -> int:
    """`nbytes` rounded up to 1/8 of its power of two (<= 12.5% more), so that a step's slightly
    larger put still fits the segment of the last one."""
    step = max(ALIGN, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class Segments:
    """One client's segments: those it writes (reused once their partition is cleared and no reader
    holds them) and the mappings of those it reads."""

    def __init__(self, prefix: str) -> None:
        # the writer's pid and a token of its own: a later process given the same pid never
        # writes under a name a reader still has mapped
        self._prefix = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._busy: dict[str, list[_Segment]] = {}  # partition -> segments its puts wrote
        self._free: list[_Segment] = []
        self._warned = False
        self.held_at_reuse = 0  # free segments passed over because a reader still held them
        self._mapped: dict[str, _Kept] = {}  # segments read, kept mapped for the next get (oldest first)

    # ------------------------------------------------------------------ writing
    def place(self, partition: str, columns: dict[str, _Column]) -> "Placed | None":
        """Room in a segment for the large tensor columns of one put, and their cells, before a byte
        is written: the put sends the cells to the storage unit and copies the bytes (`Placed.write`)
        while the unit stores them. None when no column is large enough or no segment could be made."""
        sizes = {name: _nbytes(col.value) for name, col in columns.items() if col.kind in ("dense", "ragged")}
        big = {name: columns[name] for name, n in sizes.items()
               if n >= max(MIN_BYTES, MIN_ROW_BYTES * len(columns[name].value))}
        if not big:
            return None
        offsets, total = {}, 0
        for name in big:
            offsets[name] = total
            total += -(-sizes[name] // ALIGN) * ALIGN
        segment = self._take(total)
        if segment is None:
            return None
        try:
            cells_ = _cells(segment, big, offsets)
        except BaseException:
            self._give_back(segment)
            raise
        with self._lock:  # the partition's clear frees it (`forget`), written or not
            self._busy.setdefault(partition, []).append(segment)
        return Placed(segment, big, offsets, cells_)

    def _take(self, nbytes: int) -> _Segment | None:
        with self._lock:
            for best in sorted((s for s in self._free if s.capacity >= nbytes), key=lambda s: s.capacity):
                if _held(best):  # a reader still has tensors over it: never written under them
                    self.held_at_reuse += 1
                    continue
                self._free.remove(best)
                return best
        return self._make(_capacity(nbytes))

    def _make(self, capacity: int) -> _Segment | None:
        name = f"{self._prefix}-{next(self._count)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            self._cannot(path, e)
            return None
        try:
            os.posix_fallocate(fd, 0, capacity)  # the pages now, or ENOSPC now: never a SIGBUS later
            buffer = mmap.mmap(fd, capacity)
        except OSError as e:  # full, or a /dev/shm that cannot: these columns go as bytes
            os.close(fd)
            _unlink(path)
            self._cannot(path, e)
            return None
        return _Segment(name, buffer, capacity, fd)

    def _cannot(self, path: str, e: OSError) -> None:
        if not self._warned and e.errno not in (errno.ENOSPC, errno.ENOMEM):
            self._warned = True
            warnings.warn(f"rlgraph could not make a shared-memory segment {path} ({e}); large columns go through "
                          f"TransferQueue's sockets instead (dataplane.shared_memory=false says so up front)")

    def _give_back(self, segment: _Segment) -> None:
        with self._lock:
            self._free.append(segment)
            extra = []
            while len(self._free) > KEEP_FREE or sum(s.capacity for s in self._free) > KEEP_FREE_BYTES:
                extra.append(self._free.pop(0))  # the oldest
        for s in extra:
            self._drop(s)

    def forget(self, partition: str) -> None:
        """`partition` was cleared: no one reads its segments any more; they are free for reuse. The kept
        mappings of segments their writers removed are let go too (a reader that gets no more would
        otherwise keep their memory)."""
        with self._lock:
            done = self._busy.pop(partition, [])
            self._drop_removed()
        for s in done:
            self._give_back(s)

    def in_use(self) -> int:
        """Segments holding rows of partitions not yet cleared."""
        with self._lock:
            return sum(len(v) for v in self._busy.values())

    def free(self) -> int:
        with self._lock:
            return len(self._free)

    # ------------------------------------------------------------------ reading
    def lease(self, name: str) -> "mmap.mmap | _Leased":
        """Segment `name`, mapped copy-on-write for one get, under a shared lock that lasts as long as
        the get's last tensor: its writer does not write it again before (`_held`).

        The mapping is kept for the next get of the segment (`_Kept`) where this machine can tell
        which of its pages a reader wrote (`_pagemap`): then the lease is an array over it that holds
        the lock, and `populate` maps in only what is missing. Else, or while an earlier get of the
        segment still holds tensors over the kept mapping, a mapping of its own."""
        if not _NAME.match(name):
            raise DataPlaneError(f"{name!r} is not the name of an rlgraph shared-memory segment")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise DataPlaneError(
                f"shared-memory segment {path} does not exist: its partition was cleared, or this process runs on "
                f"another machine than the one that wrote it (a run on several nodes needs "
                f"dataplane.shared_memory=false)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            kept = self._keep(name, path, fd) if _pagemap() is not None else None
            if kept is None:
                # the lock belongs to the open file, which the mapping keeps (mmap holds a duplicate of
                # fd): it goes when the mapping does
                return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                leased = np.frombuffer(kept.mapping, dtype=np.uint8).view(_Leased)
                leased.kept = kept
                # the lock's file is closed, and the kept mapping free for the next get, once the
                # last tensor over this lease is gone
                weakref.finalize(leased, _release, fd, kept)
            except BaseException:
                kept.leases = 0  # as `_release` frees it
                raise
            fd = -1
            return leased
        finally:
            if fd >= 0:
                os.close(fd)

    def _keep(self, name: str, path: str, locked: int) -> "_Kept | None":
        """The kept mapping of segment `name` for one more get (made now if there is none), or None
        when an earlier get still holds tensors over it."""
        ino = os.fstat(locked).st_ino
        with self._lock:
            self._drop_removed()
            kept = self._mapped.pop(name, None)
            if kept is not None and kept.ino != ino:  # never: names are not reused; a mapping of its own
                self._unmap(kept)
                kept = None
            if kept is not None:
                self._mapped[name] = kept  # the most recently used last
                if kept.leases:
                    return None
                kept.leases = 1
                return kept
        # the same file as the locked descriptor, opened anew (no lock on this one: the kept mapping holds
        # none), even if its writer removed it since: not by its path, which may be gone
        fd = os.open(f"/proc/self/fd/{locked}", os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        kept = _Kept(name, mapping, fd, ino, len(mapping),
                     np.frombuffer(mapping, dtype=np.uint8).__array_interface__["data"][0], leases=1, fresh=True)
        # its descriptor is closed when it is unmapped, or, if another thread's get of the same segment
        # took its place meanwhile, once nothing holds it
        kept.closer = weakref.finalize(kept, os.close, fd)
        with self._lock:
            self._mapped[name] = kept
            while len(self._mapped) > KEEP_MAPPED or sum(k.size for k in self._mapped.values()) > KEEP_MAPPED_BYTES:
                idle = next((k for k in self._mapped.values() if not k.leases), None)
                if idle is None:
                    break
                self._unmap(self._mapped.pop(idle.name))
        return kept

    def _drop_removed(self) -> None:
        """Unmap the kept segments their writer has removed and no get holds: a removed segment's
        memory lasts as long as a mapping of it (under `_lock`)."""
        for name in [n for n, k in self._mapped.items() if not k.leases and os.fstat(k.fd).st_nlink == 0]:
            self._unmap(self._mapped.pop(name))

    @staticmethod
    def _unmap(kept: "_Kept") -> None:
        _close(kept.mapping)
        kept.closer()

    def mapped(self) -> int:
        """Segments this client keeps mapped for its next gets."""
        with self._lock:
            return len(self._mapped)

    def populate(self, mapping: "mmap.mmap | _Leased", offset: int, nbytes: int) -> None:
        """Map `nbytes` of `mapping` from `offset` in now. A kept mapping's pages a reader wrote
        (its own copies: stale for this get) are dropped first, and only pages not mapped are read."""
        if isinstance(mapping, _Leased):
            _refresh(mapping.kept, offset, nbytes)
        else:
            populate(mapping, offset, nbytes)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Remove the free segments and unmap the rest; segments still holding rows stay for their
        readers (the driver removes them with the plane)."""
        with self._lock:
            free, self._free = self._free, []
            busy = [s for v in self._busy.values() for s in v]
            self._busy.clear()
            kept, self._mapped = list(self._mapped.values()), {}
        for s in free:
            self._drop(s)
        for s in busy:
            _close(s.buffer)
            os.close(s.fd)
        for k in kept:  # a get's tensors over one keep it mapped until they are gone
            self._unmap(k)

    def _drop(self, segment: _Segment) -> None:
        """Remove a free segment: its file and the writer's mapping (a reader's lasts while it holds it)."""
        _unlink(os.path.join(SHM_DIR, segment.name))
        _close(segment.buffer)
        os.close(segment.fd)


@dataclass
class _Kept:
    """A segment a reader keeps mapped (copy-on-write) between its gets: mapping its pages in again
    for every get cost more than the get's other work (16 MB: 0.6-1.0 ms)."""
    name: str
    mapping: mmap.mmap
    fd: int  # unlocked: tells whether the writer removed the file (`Segments._drop_removed`)
    ino: int
    size: int
    address: int  # where the mapping starts, for `_pagemap`
    leases: int  # gets whose tensors over it are alive (0 or 1: a second get maps its own)
    fresh: bool  # no page of it mapped in yet
    closer: Callable[[], Any] = field(default=lambda: None, repr=False)  # closes `fd` once


class _Leased(np.ndarray):
    """A kept mapping's bytes as one get hands them out: tensors over it keep it alive, and with it
    the get's lock on the segment (`Segments.lease`)."""
    kept: _Kept


def _release(fd: int, kept: _Kept) -> None:
    """A get's last tensor over a kept mapping is gone: its lock goes, and the mapping is free for the
    next get. No lock taken: the garbage collector may run this inside `Segments._lock`."""
    os.close(fd)
    kept.leases = 0


def _refresh(kept: _Kept, offset: int, nbytes: int) -> None:
    """Make a kept mapping's bytes from `offset` those of the segment again: the pages an earlier get's
    op wrote into (copy-on-write: its own, or swapped out) are dropped, so that they map the segment's
    again, and pages not mapped are mapped in (`populate`)."""
    if nbytes <= 0:
        return
    if kept.fresh:  # nothing mapped in, nothing written: every page from the segment
        populate(kept.mapping, offset, nbytes)
        kept.fresh = False
        return
    page = mmap.PAGESIZE
    first = offset // page
    count = -(-(offset + nbytes) // page) - first
    entries = _pagemap_entries(kept.address // page + first, count)
    if entries is None:  # never once the check passed; the mapping is dropped whole instead
        kept.mapping.madvise(mmap.MADV_DONTNEED, first * page, count * page)
        populate(kept.mapping, offset, nbytes)
        return
    if ((entries & _STATE) == _MAPPED).all():  # every page mapped, none written: the segment's
        return
    present = (entries & _PRESENT) != 0
    own = ((entries & _SWAPPED) != 0) | present & ((entries & _FILE) == 0)
    if own.any():
        pages = np.flatnonzero(own)
        for run in np.split(pages, np.flatnonzero(np.diff(pages) != 1) + 1):  # one madvise a run of pages
            kept.mapping.madvise(mmap.MADV_DONTNEED, int(first + run[0]) * page, int(run.size) * page)
        present &= ~own
    missing = np.flatnonzero(~present)
    if missing.size:  # a read of each maps it in (and the kernel maps the pages around it)
        np.frombuffer(kept.mapping, dtype=np.uint8)[(first + missing) * page].max()


# /proc/self/pagemap: a 64-bit entry a page; what `_refresh` reads (the kernel's pagemap.rst)
_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)
_FILE = np.uint64(1 << 61)  # a page of the file (or shared), not a private copy
_STATE = _PRESENT | _SWAPPED | _FILE
_MAPPED = _PRESENT | _FILE
_PAGEMAP: list[int | None] = []  # this process's pagemap descriptor, or None where it cannot be used
_PAGEMAP_LOCK = threading.Lock()


def _pagemap() -> int | None:
    """This process's ``/proc/self/pagemap``, opened once, if it tells a page this process wrote in a
    copy-on-write mapping of a shared-memory file from the file's own (checked once: `_pagemap_works`);
    else None, and every get maps its segments anew."""
    if not _PAGEMAP:
        with _PAGEMAP_LOCK:
            if not _PAGEMAP:
                _PAGEMAP.append(_pagemap_works())
    return _PAGEMAP[0]


def _forget_pagemap() -> None:
    """In a forked child: its own pagemap, opened at its first need; the parent's descriptor (which reads
    the parent's pages) closed, and a lock of its own (another thread may have held the parent's)."""
    global _PAGEMAP_LOCK
    _PAGEMAP_LOCK = threading.Lock()
    inherited = _PAGEMAP[0] if _PAGEMAP else None
    _PAGEMAP.clear()
    if inherited is not None:
        try:
            os.close(inherited)
        except OSError:
            pass


os.register_at_fork(after_in_child=_forget_pagemap)


def _pagemap_entries(first_page: int, count: int) -> np.ndarray | None:
    fd = _pagemap()
    if fd is None:
        return None
    try:
        raw = os.pread(fd, count * 8, first_page * 8)
    except OSError:
        return None
    if len(raw) != count * 8:
        return None
    return np.frombuffer(raw, dtype=np.uint64)


def _pagemap_works() -> int | None:
    """Open this process's pagemap and check, on a two-page shared-memory file mapped copy-on-write,
    that a page read shows as the file's and a page written as not, and that dropping the written one
    maps the file's bytes again."""
    try:
        pm = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    page = mmap.PAGESIZE
    try:
        fd = os.memfd_create("rlgraph-pagemap-check")
    except (OSError, AttributeError):
        os.close(pm)
        return None
    ok = False
    try:
        os.ftruncate(fd, 2 * page)
        with mmap.mmap(fd, 2 * page) as shared, \
                mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as private:
            shared[:] = b"\1" * (2 * page)
            _ = private[0], private[page]  # both mapped in, the file's
            private[page] = 2  # a copy of its own
            view = np.frombuffer(private, dtype=np.uint8)
            start = view.__array_interface__["data"][0] // page
            del view
            read, written = np.frombuffer(os.pread(pm, 16, start * 8), dtype=np.uint64)
            ok = bool(read & _PRESENT) and bool(read & _FILE) and bool(written & _PRESENT) and not written & _FILE
            if ok:
                private.madvise(mmap.MADV_DONTNEED, page, page)
                ok = private[page] == 1
    except (OSError, ValueError):
        ok = False
    finally:
        os.close(fd)
    if not ok:
        os.close(pm)
        return None
    return pm


def populate(buffer: mmap.mmap, offset: int, nbytes: int) -> None:
    """Map `nbytes` of a reader's mapping from `offset` in now, rather than page by page as the op
    reads them (so a get's time includes its pages): one read every `_AROUND` bytes, each fault
    mapping the pages around it that the segment holds (the kernel's fault-around, 64 KiB by
    default). 16 MB: 0.75 ms, where ``MADV_POPULATE_READ`` took 1.1 ms and a fault per page 1.0."""
    if nbytes > 0:
        np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset)[::_AROUND].max()


def _held(segment: _Segment) -> bool:
    """Whether a reader still holds `segment` (a shared lock on its file, `Segments.lease`)."""
    try:
        fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(segment.fd, fcntl.LOCK_UN)
    return False


def _close(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:  # a tensor still views it: unmapped when that tensor is gone
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or another user's (/dev/shm is sticky)
        pass


def remove_all(prefix: str) -> int:
    """Remove every segment whose name starts with `prefix` (a plane's, or a driver's); how many."""
    return _remove(lambda name: name.startswith(prefix + "-"))


def sweep() -> int:
    """Remove the segments of drivers that are no longer running (a run killed without its
    reaper); how many. A live driver's segments are never touched."""
    here = namespace()

    def gone(name: str) -> bool:
        m = _NAME.match(name)
        return bool(m) and m.group(1) == here and not _alive(int(m.group(2)))

    return _remove(gone)


def _remove(which: Callable[[str], bool]) -> int:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    uid = os.getuid()
    chosen = [name for name in names if which(name) and _owned(name, uid)]
    for name in chosen:
        _unlink(os.path.join(SHM_DIR, name))
    return len(chosen)


def _owned(name: str, uid: int) -> bool:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_uid == uid
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


