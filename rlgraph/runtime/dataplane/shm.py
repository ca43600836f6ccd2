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
from dataclasses import dataclass, field
from typing import Callable

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
        """`partition` was cleared: no one reads its segments any more; they are free for reuse."""
        with self._lock:
            done = self._busy.pop(partition, [])
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
    def lease(self, name: str) -> mmap.mmap:
        """Segment `name`, mapped copy-on-write for one get, under a shared lock that lasts as long as
        the mapping (its last tensor): its writer does not write it again before (`_held`)."""
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
            # the lock belongs to the open file, which the mapping keeps (mmap holds a duplicate of
            # fd): it goes when the mapping does
            fcntl.flock(fd, fcntl.LOCK_SH)
            return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def populate(self, mapping: mmap.mmap, offset: int, nbytes: int) -> None:
        populate(mapping, offset, nbytes)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Remove the free segments and unmap the rest; segments still holding rows stay for their
        readers (the driver removes them with the plane)."""
        with self._lock:
            free, self._free = self._free, []
            busy = [s for v in self._busy.values() for s in v]
            self._busy.clear()
        for s in free:
            self._drop(s)
        for s in busy:
            _close(s.buffer)
            os.close(s.fd)

    def _drop(self, segment: _Segment) -> None:
        """Remove a free segment: its file and the writer's mapping (a reader's lasts while it holds it)."""
        _unlink(os.path.join(SHM_DIR, segment.name))
        _close(segment.buffer)
        os.close(segment.fd)


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


