"""rlgraph.runtime.dataplane.shm: large tensor columns through shared memory, exactly, with
segments reused once their partition is cleared and removed when their run is over. The
TransferQueue plane's use of it, across processes, is in test_dataplane.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
import warnings

import pytest
import torch

from rlgraph.rows import Rows
from rlgraph.runtime.dataplane import cells, shm
from rlgraph.runtime.dataplane.base import DataPlaneError, _Column, _normalize, assemble_rows

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this machine")


@pytest.fixture
def prefix():
    p = shm.prefix_for(os.getpid(), uuid.uuid4().hex[:12])
    yield p
    shm.remove_all(p)


@pytest.fixture
def segments(prefix):
    made = shm.Segments(prefix)
    yield made
    made.close()


def _files(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-"))


def _put(segments, partition, **columns):
    rows = len(next(iter(columns.values())))
    norm = {k: _normalize(k, v, rows) for k, v in columns.items()}
    placed = segments.place(partition, norm)  # the TQ plane sends the cells, then writes (`Placed.write`)
    if placed is not None:
        placed.write()
    shared = placed.cells if placed is not None else {}
    return {k: shared[k] if k in shared else cells.encode(c) for k, c in norm.items()}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)


def test_large_columns_go_through_a_segment_and_come_back_exactly(segments, prefix):
    dense = torch.randn(64, 512)  # 128 KiB
    ragged = [torch.arange(n * 100, dtype=torch.int64) for n in range(1, 33)]  # 422 KiB
    small = torch.ones(64, 4)
    text = [f"row {i}" for i in range(64)]
    encoded = _put(segments, "p", dense=dense, small=small, text=text)
    assert all(c[0] == ord("m") for c in encoded["dense"])
    assert all(c[0] == ord("t") for c in encoded["small"])  # below MIN_BYTES: as bytes
    assert len(encoded["dense"][0]) < 100  # a descriptor, not the row
    _same(cells.decode(encoded["dense"], segments), dense)
    _same(cells.decode(encoded["small"], segments), small)
    assert cells.decode(encoded["text"], segments) == text
    ragged_cells = _put(segments, "p", ragged=ragged)["ragged"]
    _same(cells.decode(ragged_cells, segments), ragged)
    assert len(_files(prefix)) == 2  # one segment per put
    # the same rows as `Rows` (views of one flat tensor): written from that tensor, the same cells, and
    # read back as `Rows` over the segment, padded without joining them again
    kept = Rows(torch.cat(ragged), [r.shape[0] for r in ragged])
    back = cells.decode(_put(segments, "q", ragged=kept)["ragged"], segments)
    _same(back, ragged)
    assert type(back) is Rows and torch.equal(back.padded(), torch.nn.utils.rnn.pad_sequence(ragged, batch_first=True))


def test_rows_in_any_order_and_mixed_with_byte_rows_decode_as_assemble_rows_says(segments):
    big = torch.randn(40, 1024)
    shared = _put(segments, "p", x=big)["x"]
    plain = cells.encode(_normalize("x", big[:3].clone(), 3))
    order = [5, 2, 39, 0, 1]
    _same(cells.decode([shared[i] for i in order], segments), big[order])
    mixed = plain + shared[3:]  # rows 0-2 put as bytes by another call
    _same(cells.decode(mixed, segments), big)
    half = torch.randn(40, 1024, dtype=torch.float64)
    other = _put(segments, "p", x=half)["x"]  # a second put, another dtype
    _same(cells.decode([shared[0], other[1]], segments), assemble_rows([big[0], half[1]]))


def test_a_cleared_partition_s_segment_is_written_again_by_the_next_put(prefix):
    segments = shm.Segments(prefix)
    try:
        first = _put(segments, "step_0", x=torch.randn(64, 1024))["x"]
        assert segments.in_use() == 1
        segments.forget("step_0")
        assert (segments.in_use(), segments.free()) == (0, 1)
        y = torch.randn(60, 1024)  # a little smaller: fits
        second = _put(segments, "step_1", x=y)["x"]
        assert len(_files(prefix)) == 1  # no new segment
        assert first[0][-20:] == second[0][-20:]  # the same segment's name
        _same(cells.decode(second, segments), y)  # read after the rewrite: the new rows
    finally:
        segments.close()
    # step_1 is not cleared: its segment stays for its readers (the driver removes it with the plane)
    assert len(_files(prefix)) == 1


def test_a_reused_segment_sends_its_last_cells_again_only_for_the_same_layout(prefix):
    # a dense column's cells hold only its dtype, row shape, segment and offsets: the next put of the same
    # layout into the same segment sends the very cells of the last one, any other layout cells of its own
    segments = shm.Segments(prefix)
    try:
        first = _put(segments, "step_0", x=torch.randn(64, 1024))["x"]
        segments.forget("step_0")
        y = torch.randn(64, 1024)
        second = _put(segments, "step_1", x=y)["x"]
        assert second is first
        _same(cells.decode(second, segments), y)
        segments.forget("step_1")
        for other in (torch.randn(60, 1024), torch.randn(64, 1024, dtype=torch.float64)[:, :512],
                      torch.randn(64, 2, 512)):  # fewer rows, another dtype, another row shape
            third = _put(segments, "step_2", x=other)["x"]
            assert len(_files(prefix)) == 1 and third is not first and third != first
            _same(cells.decode(third, segments), other)
            segments.forget("step_2")
        both = _put(segments, "step_3", w=torch.randn(64, 1024), x=torch.randn(64, 1024))  # a larger segment
        segments.forget("step_3")
        w, x = torch.randn(64, 1024), torch.randn(64, 1024)
        again = _put(segments, "step_4", w=w, x=x)
        assert again["w"] is both["w"] and again["x"] is both["x"] and again["w"] != again["x"]
        _same(cells.decode(again["w"], segments), w)
        _same(cells.decode(again["x"], segments), x)
    finally:
        segments.close()


def test_at_most_keep_free_segments_wait_for_reuse(prefix):
    segments = shm.Segments(prefix)
    try:
        for k in range(shm.KEEP_FREE + 3):
            _put(segments, f"step_{k}", x=torch.randn(32, 1024))
        for k in range(shm.KEEP_FREE + 3):
            segments.forget(f"step_{k}")
        assert segments.free() == shm.KEEP_FREE
        assert len(_files(prefix)) == shm.KEEP_FREE
    finally:
        segments.close()
    assert _files(prefix) == []


def test_a_full_shared_memory_sends_the_columns_as_bytes(segments, prefix, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    x = torch.randn(64, 1024)
    encoded = _put(segments, "p", x=x)["x"]
    assert encoded[0][0] == ord("t")
    _same(cells.decode(encoded, segments), x)
    assert _files(prefix) == []


def test_a_missing_segment_is_an_error_that_names_it_and_the_setting(prefix):
    segments = shm.Segments(prefix)
    try:
        encoded = _put(segments, "p", x=torch.randn(64, 1024))["x"]
        shm.remove_all(prefix)
        reader = shm.Segments(prefix)  # another process's view: nothing mapped yet
        with pytest.raises(DataPlaneError, match=r"rlgraph-.* does not exist.*dataplane.shared_memory=false"):
            cells.decode(encoded, reader)
        with pytest.raises(DataPlaneError, match="reads none"):
            cells.decode(encoded, None)
        with pytest.raises(DataPlaneError, match="not the name of an rlgraph"):
            reader.lease("../etc/passwd")
    finally:
        segments.close()


def test_sweep_removes_the_segments_of_drivers_gone_and_keeps_a_live_one_s(prefix):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(ended.stdout)
    dead = os.path.join(shm.SHM_DIR, f"{shm.prefix_for(dead_pid, 'ab12')}-{dead_pid}-cd34-0")
    live = os.path.join(shm.SHM_DIR, f"{prefix}-{os.getpid()}-cd34-0")
    # a dead pid of another pid namespace (a container sharing /dev/shm) is not ours to judge
    elsewhere = os.path.join(shm.SHM_DIR, f"rlgraph-ffff0-{dead_pid}-ab12-{dead_pid}-cd34-0")
    for path in (dead, live, elsewhere):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        shm.sweep()
        assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(elsewhere)
    finally:
        for path in (dead, live, elsewhere):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn])
def test_every_dtype_and_empty_rows_come_back_exactly(segments, dtype):
    dense = (torch.arange(64 * 2048).reshape(64, 2048) % 5).to(dtype)
    _same(cells.decode(_put(segments, "p", x=dense)["x"], segments), dense)
    ragged = [(torch.arange(n) % 3).to(dtype) for n in [0, 4096, 0, 70000, 1]]  # rows of no elements too
    encoded = _put(segments, "p", x=ragged)["x"]
    assert encoded[0][0] == ord("m")
    _same(cells.decode(encoded, segments), ragged)


def test_narrow_rows_go_as_bytes_a_descriptor_would_be_larger(segments):
    narrow = torch.randn(16384, 4)  # 256 KiB, 16 bytes a row
    assert _put(segments, "p", x=narrow)["x"][0][0] == ord("t")


def test_free_segments_are_capped_in_bytes_too(segments, prefix, monkeypatch):
    monkeypatch.setattr(shm, "KEEP_FREE_BYTES", 600 * 1024)
    for k in range(4):
        _put(segments, f"step_{k}", x=torch.randn(64, 1024))  # 256 KiB each
    for k in range(4):
        segments.forget(f"step_{k}")
    assert segments.free() == 2 and len(_files(prefix)) == 2


def test_a_removed_segment_is_never_read_through_an_old_mapping(segments, prefix):
    encoded = _put(segments, "p", x=torch.randn(64, 1024))["x"]
    reader = shm.Segments(prefix)
    try:
        cells.decode(encoded, reader)  # mapped and kept
        shm.remove_all(prefix)
        with pytest.raises(DataPlaneError, match="does not exist"):
            cells.decode(encoded, reader)
    finally:
        reader.close()


def test_a_dev_shm_that_refuses_sends_the_columns_as_bytes_with_one_warning(segments, monkeypatch):
    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(shm.os, "posix_fallocate", refuse)
    x = torch.randn(64, 1024)
    with pytest.warns(UserWarning, match="could not make a shared-memory segment"):
        assert _put(segments, "p", x=x)["x"][0][0] == ord("t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _put(segments, "q", x=x)["x"][0][0] == ord("t")


def test_a_get_maps_the_segment_and_an_op_may_write_into_what_it_got(segments):
    x = torch.randn(64, 1024)
    encoded = _put(segments, "p", x=x)["x"]
    got = cells.decode(encoded, segments)
    again = cells.decode(encoded, segments)
    before = got.untyped_storage().data_ptr()
    got.add_(1.0)  # copy-on-write: the op's own pages from here on
    _same(again, x)  # another reader's rows, and the segment, are untouched
    _same(cells.decode(encoded, segments), x)
    assert got.untyped_storage().data_ptr() == before and torch.equal(got, x + 1.0)


def test_a_segment_a_reader_still_holds_is_never_written_by_a_later_put(prefix):
    writer = shm.Segments(prefix)
    reader = shm.Segments(prefix)
    try:
        x = torch.randn(64, 1024)
        held = cells.decode(_put(writer, "step_0", x=x)["x"], reader)
        row = held[3]  # a view of one row holds the whole mapping
        del held
        writer.forget("step_0")
        y = torch.randn(64, 1024)
        second = _put(writer, "step_1", x=y)["x"]
        assert len(_files(prefix)) >= 2 and writer.held_at_reuse >= 1  # a new segment, not the held one
        assert torch.equal(row, x[3])
        _same(cells.decode(second, reader), y)
        del row  # let go: the segment is free to write again
        writer.forget("step_1")
        files = len(_files(prefix))
        _put(writer, "step_3", x=y)
        assert len(_files(prefix)) == files  # reused
    finally:
        reader.close()
        writer.close()


def test_a_segment_removed_while_held_keeps_its_rows_for_the_holder(prefix):
    writer = shm.Segments(prefix)
    x = [torch.randn(n) for n in (300, 5000, 70)]
    got = cells.decode(_put(writer, "p", x=x)["x"], writer)
    writer.close()
    shm.remove_all(prefix)
    assert _files(prefix) == []
    _same(got, x)


def test_rows_of_several_puts_come_back_joined_when_dense_and_as_views_when_ragged(segments):
    a, b = torch.randn(32, 1024), torch.randn(32, 1024)
    first, second = _put(segments, "p", x=a)["x"], _put(segments, "p", x=b)["x"]
    _same(cells.decode(first + second, segments), torch.cat([a, b]))
    _same(cells.decode(second[5:9] + first[:3], segments), torch.cat([b[5:9], a[:3]]))
    ra = [torch.randn(n) for n in (100, 2000, 0, 30)]
    rb = [torch.randn(n) for n in (700, 1)]
    ca, cb = _put(segments, "p", x=ra)["x"], _put(segments, "p", x=rb)["x"]
    _same(cells.decode(cb + ca, segments), rb + ra)
    _same(cells.decode([ca[3], ca[1], cb[0]], segments), [ra[3], ra[1], rb[0]])


def test_ragged_rows_of_several_dimensions_and_rows_that_need_grad_are_written_exactly(segments):
    rows = [torch.randn(n, 3, requires_grad=True) for n in (40, 500, 7)]
    _same(cells.decode(_put(segments, "p", x=rows)["x"], segments), [r.detach() for r in rows])
    strided = [torch.randn(n, 8)[:, ::2] for n in (200, 300, 100)]  # not contiguous
    _same(cells.decode(_put(segments, "p", x=strided)["x"], segments), [s.contiguous() for s in strided])


@pytest.mark.parametrize("threads", [1, 2])
def test_every_kind_of_large_column_is_copied_exactly_and_the_caller_keeps_its_torch_threads(segments, threads):
    """Each copy: a dense column (one C memmove), a `Rows` kept flat, ragged rows (one torch.cat,
    on one torch thread, given back) and a strided dense tensor (copy_)."""
    write = cells.write
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense = torch.randn(333, 257)
        ragged = [torch.randn(n) for n in (1, 20000, 3, 7000, 9000, 0, 15)]
        two = [torch.randn(30000), torch.randn(5)]  # the first row is most of it
        flat = Rows(torch.arange(3940, dtype=torch.float64), [900, 40, 3000])
        for x in (dense, ragged, two, flat):
            _same(cells.decode(_put(segments, "p", x=x)["x"], segments), list(x) if x is flat else x)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    strided = torch.randn(64, 1024)[:, ::2]  # the copy_ path; a put's own dense columns are contiguous
    buffer = bytearray(strided.numel() * 4 + 64)
    write(_Column("dense", strided), buffer, 64)
    assert torch.equal(torch.frombuffer(buffer, dtype=torch.float32, offset=64).view(64, 512), strided)
    lazy = torch.randn(8, 64, dtype=torch.complex64).conj()  # contiguous, conjugated only by a flag
    buffer = bytearray(lazy.numel() * 8)
    write(_Column("dense", lazy), buffer, 0)
    assert torch.equal(torch.frombuffer(buffer, dtype=torch.complex64).view(8, 64), lazy.resolve_conj())
    with pytest.raises(ValueError):  # a column larger than the room left is never written past it
        write(_Column("dense", strided), buffer, 128)


def test_a_placed_put_s_cells_come_before_its_bytes_and_a_failed_copy_frees_its_segment(segments, monkeypatch):
    """`place` gives a put's cells before a byte is written (the TQ plane sends them, then copies
    while the storage unit stores them); the rows read right once `write` has run. A copy that
    fails raises; its segment stays with its partition (its cells may be stored) until that is cleared."""
    big = _normalize("x", torch.randn(32, 1024), 32)
    placed = segments.place("p", {"x": big})
    assert placed is not None and set(placed.cells) == {"x"} and segments.in_use() == 1
    placed.write()
    _same(cells.decode(placed.cells["x"], segments), big.value)

    def broken(*_, **__):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cells, "write", broken)
    failed = segments.place("q", {"x": big})
    with pytest.raises(RuntimeError, match="copy failed"):
        failed.write()
    assert segments.in_use() == 2 and segments.free() == 0  # no later put writes under q's cells
    segments.forget("q")
    assert segments.in_use() == 1 and segments.free() == 1
    assert segments.place("q", {"y": _normalize("y", torch.ones(2, 2), 2)}) is None  # nothing large: no room taken


def _kept_mappings_work() -> bool:
    return shm._pagemap() is not None


@pytest.mark.skipif(not _kept_mappings_work(), reason="this machine's pagemap cannot tell a reader's own pages")
def test_a_kept_mapping_gives_each_get_the_segment_s_bytes_never_what_an_earlier_op_wrote(prefix):
    writer = shm.Segments(prefix)
    reader = shm.Segments(prefix)
    try:
        x = torch.randn(256, 1024)  # 1 MiB: 256 pages
        encoded = _put(writer, "step_0", x=x)["x"]
        got = cells.decode(encoded, reader)
        assert reader.mapped() == 1
        got[3].add_(1.0)  # one page of it now the op's own
        got[200:210] = 0.0  # and a run of pages
        del got
        again = cells.decode(encoded, reader)  # the kept mapping, its written pages dropped
        assert reader.mapped() == 1
        _same(again, x)
        # a second get while the first's tensors live maps its own: writes through one never show in the other
        other = cells.decode(encoded, reader)
        other.mul_(0.0)
        _same(again, x)
        del other
        again[7] = 5.0
        del again
        # the writer writes the segment again for the next step: the reader sees the new bytes
        writer.forget("step_0")
        y = torch.randn(256, 1024)
        second = _put(writer, "step_1", x=y)["x"]
        assert second == encoded  # the same segment, reused, and the same cells: parsed once (`cells._TABLES`)
        _same(cells.decode(second, reader), y)
        assert reader.mapped() == 1
    finally:
        reader.close()
        writer.close()


@pytest.mark.skipif(not _kept_mappings_work(), reason="this machine's pagemap cannot tell a reader's own pages")
def test_a_get_over_a_kept_mapping_holds_the_segment_until_its_last_tensor_is_gone(prefix):
    writer = shm.Segments(prefix)
    reader = shm.Segments(prefix)
    try:
        encoded = _put(writer, "step_0", x=torch.randn(64, 1024))["x"]
        row = cells.decode(encoded, reader)[5]  # a view of one row: the get's lock stays
        segment = writer._busy["step_0"][0]
        assert shm._held(segment)
        del row
        assert not shm._held(segment)
        # rows mixed with byte rows are read through the kept mapping too, its written pages dropped
        got = cells.decode(encoded, reader)
        got.zero_()
        del got
        x = torch.randn(3, 1024)
        plain = cells.encode(_normalize("x", x, 3))
        mixed = cells.decode(plain + encoded[3:], reader)
        assert torch.count_nonzero(mixed[3:]) > 0 and torch.equal(mixed[:3], x)
    finally:
        reader.close()
        writer.close()


@pytest.mark.skipif(not _kept_mappings_work(), reason="this machine's pagemap cannot tell a reader's own pages")
def test_a_reader_lets_go_of_kept_mappings_of_removed_segments_and_keeps_at_most_keep_mapped(prefix, monkeypatch):
    writer = shm.Segments(prefix)
    reader = shm.Segments(prefix)
    try:
        first = _put(writer, "a", x=torch.randn(64, 1024))["x"]
        second = _put(writer, "b", x=torch.randn(64, 1024))["x"]
        cells.decode(first, reader)
        assert reader.mapped() == 1
        name = bytes(first[0][-len(_files(prefix)[0]):]).decode()
        os.unlink(os.path.join(shm.SHM_DIR, name))  # its writer removed it: its memory must go
        cells.decode(second, reader)
        assert reader.mapped() == 1 and name not in reader._mapped
        monkeypatch.setattr(shm, "KEEP_MAPPED", 2)
        for k in range(4):
            cells.decode(_put(writer, f"c{k}", x=torch.randn(64, 1024))["x"], reader)
        assert reader.mapped() == 2
    finally:
        reader.close()
        writer.close()


@pytest.mark.skipif(not _kept_mappings_work(), reason="this machine's pagemap cannot tell a reader's own pages")
def test_a_segment_removed_between_a_reader_s_two_opens_is_kept_and_let_go_when_a_partition_is_cleared(prefix):
    writer = shm.Segments(prefix)
    reader = shm.Segments(prefix)
    try:
        x = torch.randn(64, 1024)
        _put(writer, "a", x=x)
        name = _files(prefix)[0]
        path = os.path.join(shm.SHM_DIR, name)
        locked = os.open(path, os.O_RDONLY)  # the get's locked descriptor (`Segments.lease`)
        try:
            os.unlink(path)  # its writer removes it before the reader maps it to keep
            kept = reader._keep(name, path, locked)  # the same file, opened anew without its path
            assert kept is not None and reader.mapped() == 1
            assert torch.equal(torch.frombuffer(kept.mapping, dtype=torch.float32, count=x.numel()).view_as(x), x)
        finally:
            os.close(locked)
        kept.leases = 0  # the get's last tensor gone (`_release`)
        del kept
        reader.forget("some partition")  # a reader that gets no more still lets go of removed segments
        assert reader.mapped() == 0
    finally:
        reader.close()
        writer.close()


def test_a_forked_child_closes_the_parent_s_pagemap_and_takes_a_lock_of_its_own(monkeypatch):
    fd = os.open(os.devnull, os.O_RDONLY)  # standing in for the parent's /proc/self/pagemap
    monkeypatch.setattr(shm, "_PAGEMAP", [fd])
    monkeypatch.setattr(shm, "_PAGEMAP_LOCK", shm._PAGEMAP_LOCK)  # put back after the test
    parents = shm._PAGEMAP_LOCK
    shm._forget_pagemap()  # what os.fork runs in the child
    assert shm._PAGEMAP == [] and shm._PAGEMAP_LOCK is not parents
    with pytest.raises(OSError):
        os.fstat(fd)


def test_where_pagemap_cannot_tell_each_get_maps_its_segment_anew(segments, monkeypatch):
    monkeypatch.setattr(shm, "_PAGEMAP", [None])
    x = torch.randn(64, 1024)
    encoded = _put(segments, "p", x=x)["x"]
    got = cells.decode(encoded, segments)
    got.add_(1.0)
    del got
    _same(cells.decode(encoded, segments), x)
    assert segments.mapped() == 0


@pytest.mark.skipif(not _kept_mappings_work(), reason="this machine's pagemap cannot tell a reader's own pages")
def test_a_get_s_tensors_collected_inside_the_reader_s_lock_let_go_and_a_replaced_kept_mapping_closes_its_file(
        segments):
    import gc
    import threading

    encoded = _put(segments, "p", x=torch.randn(64, 1024))["x"]
    got = cells.decode(encoded, segments)
    kept = next(iter(segments._mapped.values()))
    cycle = [got]
    cycle.append(cycle)  # freed only by the garbage collector, which may run anywhere
    del got, cycle
    done = threading.Event()

    def collect_under_the_lock():
        with segments._lock:
            gc.collect()
        done.set()

    t = threading.Thread(target=collect_under_the_lock, daemon=True)
    t.start()
    assert done.wait(10), "the lease's release waited on the reader's own lock"
    assert kept.leases == 0
    # another thread's get of the same segment took its place: the one replaced closes its file when unused
    again = cells.decode(encoded, segments)
    replaced = segments._mapped.pop(kept.name)
    fd = replaced.fd
    del again, replaced, kept
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
