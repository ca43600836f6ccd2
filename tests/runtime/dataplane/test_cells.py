"""The TransferQueue plane's cell codec: every column kind survives encode -> decode exactly,
and decode gives what `assemble_rows` gives for the same rows (the rule both backends share)."""

import pytest
import torch

from rlgraph.rows import Rows
from rlgraph.runtime.dataplane import cells
from rlgraph.runtime.dataplane.base import DataPlaneError, _normalize, assemble_rows


def _round_trip(value, rows):
    col = _normalize("c", value, rows)
    encoded = cells.encode(col)
    assert len(encoded) == rows and all(type(c) is bytes for c in encoded)
    return encoded, cells.decode(encoded)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    else:
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                _same(x, y)
            else:
                assert x == y and type(x) is type(y)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn])
def test_dense_columns_of_every_dtype_come_back_dense_and_equal(dtype):
    value = (torch.arange(24).reshape(6, 2, 2) % 3).to(dtype)
    _, back = _round_trip(value, 6)
    _same(value, back)
    _, back = _round_trip(value[:, 0, 0], 6)  # one value a row
    _same(value[:, 0, 0], back)


def test_ragged_rows_come_back_as_the_same_per_row_tensors():
    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 0, 5)]
    _, back = _round_trip(rows, 4)
    _same(rows, back)
    assert type(back) is Rows and back.lengths == [3, 1, 0, 5]  # 1-D rows: views of one flat tensor
    kept = Rows(torch.cat(rows), [3, 1, 0, 5])  # the same rows as `Rows`: the same cells, from its flat tensor
    assert cells.encode(_normalize("c", kept, 4)) == cells.encode(_normalize("c", rows, 4))
    same = Rows(torch.arange(6), [3, 3])  # rows of one length: dense, as a list of them would be
    _same(_normalize("c", same, 2).value, torch.arange(6).view(2, 3))
    grid = [torch.randn(n, 3) for n in (2, 4, 1)]  # rows of two dimensions
    _, back = _round_trip(grid, 3)
    _same(grid, back)


def test_rows_of_several_puts_follow_the_assemble_rule():
    """Cells written by different calls meet in one get: one shape -> dense, else a list, and
    rows of different dtypes each keep their own."""
    a = cells.encode(_normalize("c", torch.ones(2, 3), 2))
    b = cells.encode(_normalize("c", torch.zeros(2, 3), 2))
    c = cells.encode(_normalize("c", torch.zeros(1, 4), 1))
    d = cells.encode(_normalize("c", torch.zeros(1, 3, dtype=torch.int64), 1))
    for parts in ([a, b], [a, c], [a, d]):
        got = cells.decode([x for p in parts for x in p])
        want = assemble_rows([cells.decode([x])[0] for p in parts for x in p])
        _same(want, got)
    assert isinstance(cells.decode(a + b), torch.Tensor)
    assert isinstance(cells.decode(a + c), list)


def test_strings_and_objects_keep_their_values_and_types():
    values = ["3+4=", "", "ünï", {"ground_truth": "7", "n": [1, 2.5, None]}, [1, "a"], None, 3.5, 7, True, b"raw"]
    encoded, back = _round_trip(values, len(values))
    assert back == values and [type(v) for v in back] == [type(v) for v in values]
    assert encoded[0] == b"s3+4="
    _, back = _round_trip([(1, 2), {1: "a"}], 2)  # JSON's forms: a tuple is a list, keys are strings
    assert back == [[1, 2], {"1": "a"}]


def test_a_column_of_only_objects_or_only_strings_decodes_as_row_by_row_would():
    """All-JSON and all-string columns are decoded in one parse (one JSON array; one pass), not one
    call per row: the values and their types are the same, each row's object its own."""
    objects = [{"index": i, "x": [1.5, None, 'q"\\,]'], "nan": float("nan")} for i in range(5)] + [[], {}, 0, "s"]
    encoded, back = _round_trip(objects, len(objects))
    assert all(c[:1] == b"j" for c in encoded[:-1])  # "s" is a string, its own tag: a mixed column
    import json
    import math

    assert json.dumps(back) == json.dumps(objects) and math.isnan(back[0]["nan"])
    encoded, back = _round_trip(objects[:5], 5)
    assert json.dumps(back) == json.dumps(objects[:5]) and back[0] is not back[1] and back[0]["x"] is not back[1]["x"]
    strings = ["3+4=", "", "ünï", "a\x00b", "[1,2]"]
    _, back = _round_trip(strings, len(strings))
    assert back == strings and all(type(v) is str for v in back)


def test_an_object_repeated_in_a_column_is_encoded_once_and_decoded_into_rows_of_their_own(monkeypatch):
    """A source repeats each prompt's objects n times: each distinct object is encoded once; every
    row still decodes to an object of its own, and equal objects that are not the same are each encoded."""
    info, twin = {"index": 3, "split": "train"}, {"index": 3, "split": "train"}
    values = [info] * 4 + [twin, "7", "7"]
    seen = []
    real = cells._object
    monkeypatch.setattr(cells, "_object", lambda v: seen.append(v) or real(v))
    encoded, back = _round_trip(values, len(values))
    assert seen == [info, twin, "7"] and seen[1] is twin
    assert back == values and back[0] is not back[1]
    assert encoded[0] == encoded[4] == b'j{"index":3,"split":"train"}'


def test_objects_are_never_unpickled_and_code_objects_are_refused():
    """A cell is data: an object that only pickle could carry is an error at the put, naming what
    goes instead, and no decode path runs an unpickler."""
    with pytest.raises(DataPlaneError, match="object.*cannot go through the data plane"):
        cells.encode(_normalize("c", [object()], 1))
    import pickle

    with pytest.raises(DataPlaneError):  # a pickle written by someone else is not a cell
        cells.decode([b"p" + pickle.dumps({"a": 1})])


def test_decoded_tensors_are_writable_and_own_their_memory():
    _, back = _round_trip(torch.arange(6).reshape(3, 2), 3)
    back += 1  # no read-only buffer underneath
    assert back.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_a_cell_not_written_by_rlgraph_is_a_clear_error():
    with pytest.raises(DataPlaneError, match="rlgraph's encoding"):
        cells.decode([torch.ones(2)])
    with pytest.raises(DataPlaneError, match="mixes tensors and objects"):
        cells.decode(cells.encode(_normalize("c", ["a"], 1)) + cells.encode(_normalize("c", torch.ones(1, 2), 1)))


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_an_unsupported_dtype_names_the_ones_that_go():
    with pytest.raises(DataPlaneError, match="dtype"):
        cells.encode(_normalize("c", torch.ones(2, dtype=torch.complex32), 2))


def test_dense_rows_are_parsed_at_once_only_when_every_header_agrees():
    one = torch.randn(1, 5)
    _same(one, _round_trip(one, 1)[1])
    empty = torch.zeros(3, 0)
    _same(empty, _round_trip(empty, 3)[1])
    # cells of one length whose shapes differ (2 x 3 and 3 x 2): rows of a list, never one tensor
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    mixed = cells.encode(_normalize("c", [a], 1)) + cells.encode(_normalize("c", [b], 1))
    assert len(mixed[0]) == len(mixed[1])
    _same([a, b], cells.decode(mixed))
    big = torch.randint(0, 1000, (4096, 16))
    got = cells.decode(cells.encode(_normalize("c", big, 4096)))
    _same(big, got)
    got[0, 0] = -1  # the op's own memory
    assert big[0, 0] != -1


def test_a_put_of_rows_reads_their_flat_tensor_and_lengths_without_cutting_their_views():
    """A put's byte count and cells of a `Rows` come from its flat tensor and lengths: it stays uncut
    (512 views cost 0.2-0.4 ms a column), and the cells are those of the same rows as a plain list."""
    from rlgraph.runtime.dataplane.base import _nbytes

    flat = torch.arange(10, dtype=torch.int64)
    rows = Rows(flat, [3, 0, 7])
    plain = [flat[:3], flat[3:3], flat[3:]]
    col = _normalize("responses", rows, 3)
    assert col.kind == "ragged" and _nbytes(rows) == 80
    assert cells.encode(col) == cells.encode(_normalize("responses", plain, 3))
    assert cells.shared(col, "seg", 64) == cells.shared(_normalize("responses", plain, 3), "seg", 64)
    assert list.__len__(rows) == 0  # never cut


def test_a_large_copy_is_shared_with_a_second_thread_and_done_whole_by_the_caller_when_that_thread_is_busy(
        monkeypatch):
    """`write` copies a large tensor column in chunks that the calling thread and the copier's thread take in
    turn; the bytes are the column's either way, and a copier thread that never comes costs only its help."""
    import threading

    monkeypatch.setattr(cells, "_CHUNK", 4096)  # many chunks, so that both threads take some
    monkeypatch.setattr(cells, "SHARED_COPY_BYTES", 1)
    g = torch.Generator().manual_seed(0)
    for value in (torch.randn(64, 1000, generator=g),  # 256,000 bytes: 63 chunks, the last one short
                  Rows(torch.randint(0, 1000, (9000,), generator=g), [3000, 0, 6000])):
        col = _normalize("c", value, 64 if isinstance(value, torch.Tensor) else 3)
        flat = value if isinstance(value, torch.Tensor) else value.flat
        buffer = bytearray(flat.numel() * flat.element_size() + 100)
        cells.write(col, buffer, 100)
        assert torch.equal(torch.frombuffer(buffer, dtype=torch.uint8, offset=100).view(flat.dtype).view(flat.shape),
                           flat)
    # threads writing at once each get their own bytes
    values = [torch.full((50_000,), float(i)) for i in range(4)]
    buffers = [bytearray(200_000) for _ in values]
    threads = [threading.Thread(target=cells.write, args=(_normalize("c", v.view(10, -1), 10), b, 0))
               for v, b in zip(values, buffers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v, b in zip(values, buffers):
        assert torch.equal(torch.frombuffer(b, dtype=torch.float32), v)
    # a copier whose thread never takes a chunk: the calling thread copies them all, and does not wait
    stuck = cells._Copier.__new__(cells._Copier)
    stuck._copies = type("Nowhere", (), {"put": lambda self, job: None})()
    monkeypatch.setattr(cells, "_copier", lambda: stuck)
    value = torch.randn(256, 256, generator=g)
    buffer = bytearray(value.numel() * 4)
    cells.write(_normalize("c", value, 256), buffer, 0)
    assert torch.equal(torch.frombuffer(buffer, dtype=torch.float32).view(256, 256), value)
