"""Ragged rows: padding them into one tensor, cutting them out of one, and `Rows`, which keeps both."""

import copy
import pickle

import pytest
import torch

from rlgraph.rows import Rows, left_pad, pad_flat, pad_rows, trimmed_rows


def _pad_sequence(rows):
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=0)


@pytest.mark.parametrize("lengths", [[3, 1, 4, 0, 2], [0, 0], [5]])
def test_ragged_token_rows_are_padded_as_pad_sequence_pads_them(lengths):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 9, (n,), generator=g) for n in lengths]
    assert torch.equal(pad_rows(rows), _pad_sequence(rows))
    flat = torch.cat(rows)
    assert torch.equal(pad_flat(flat, lengths), _pad_sequence(rows))
    kept = Rows(flat, lengths)
    assert [r.tolist() for r in kept] == [r.tolist() for r in rows]
    assert torch.equal(kept.padded(), _pad_sequence(rows)) and kept.padded() is kept.padded()  # made once
    assert pad_rows(kept) is kept.padded()


def test_rows_that_are_not_all_one_dimensional_are_not_padded_here():
    assert pad_rows([torch.ones(2, 3), torch.ones(1, 3)]) is None  # 2-D rows: pad_sequence pads them
    assert pad_rows([torch.tensor(1.0), torch.tensor(2.0)]) is None  # 0-d rows
    assert pad_rows([torch.ones(2), torch.ones(1, 2)]) is None  # mixed


def test_rows_changed_in_place_forget_their_flat_tensor_and_pad_what_they_hold():
    rows = Rows(torch.arange(6), [2, 1, 3])
    assert rows.padded().tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    rows[1] = torch.tensor([7, 7, 7, 7])
    assert rows.flat is None and rows.padded().tolist() == [[0, 1, 0, 0], [7, 7, 7, 7], [3, 4, 5, 0]]
    more = Rows(torch.arange(3), [1, 2])
    more.append(torch.tensor([9]))
    assert more.flat is None and more.padded().tolist() == [[0, 0], [1, 2], [9, 0]]
    for change in (lambda r: r.reverse(), lambda r: r.pop(), lambda r: r.extend([torch.tensor([1])]),
                   lambda r: r.insert(0, torch.tensor([1])), lambda r: r.__delitem__(0), lambda r: r.clear()):
        r = Rows(torch.arange(3), [1, 2])
        change(r)
        assert r.flat is None


def test_row_sums_given_with_the_rows_are_read_until_the_rows_change_as_a_list():
    from rlgraph.runtime.worker import _row_sums

    rows = Rows(torch.tensor([0.0, 1.5, 0.0, 0.0, 2.0]), [2, 0, 3], sums=[1.5, 0.0, 2.0])
    assert rows.sums == [1.5, 0.0, 2.0] and rows.shared().sums == rows.sums and _row_sums(rows) is rows.sums
    assert Rows(torch.arange(3), [1, 2]).sums is None
    with pytest.raises(ValueError, match="Rows of 2 rows given 3 row sums"):
        Rows(torch.arange(3), [1, 2], sums=[0.0, 1.0, 2.0])
    rows[0] = torch.tensor([5.0])
    assert rows.sums is None and _row_sums(rows) == [5.0, 0.0, 2.0]  # summed again, from what it holds


def test_rows_pickle_and_copy_as_plain_lists():
    # the flat tensor never travels beside its own views (a Ray call, a checkpoint)
    rows = Rows(torch.arange(5), [2, 3])
    for other in (pickle.loads(pickle.dumps(rows)), copy.copy(rows), copy.deepcopy(rows)):
        assert type(other) is list and [r.tolist() for r in other] == [[0, 1], [2, 3, 4]]
    changed = Rows(torch.arange(5), [2, 3])
    changed.append(torch.tensor([7]))  # no flat tensor left: its rows, as a list's
    assert [r.tolist() for r in pickle.loads(pickle.dumps(changed))] == [[0, 1], [2, 3, 4], [7]]


def test_trimmed_rows_cuts_each_row_to_its_length():
    padded = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    rows = trimmed_rows(padded, [2, 1, 3])
    assert type(rows) is Rows and [r.tolist() for r in rows] == [[1, 2], [3], [4, 5, 6]]
    assert [r.tolist() for r in trimmed_rows(padded, [0, 0, 1])] == [[], [], [4]]
    assert trimmed_rows(padded[:0], []) == []
    junk = torch.tensor([[1, 2, 8], [3, 8, 8]])  # what lies beyond a row's length is not kept
    assert trimmed_rows(junk, [2, 1]).padded().tolist() == [[1, 2], [3, 0]]


def test_left_pad_matches_pad_sequence_left_padding():
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8], dtype=torch.int32), torch.tensor([1, 2, 3, 4, 9])]
    ids, mask = left_pad(prompts, pad=0)
    want = torch.nn.utils.rnn.pad_sequence([p.long() for p in prompts], batch_first=True, padding_value=0,
                                           padding_side="left")
    assert ids.dtype == torch.long and torch.equal(ids, want)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    kept = Rows(torch.cat([p.long() for p in prompts]), [3, 1, 5])  # from the flat tensor, the same batch
    assert all(torch.equal(a, b) for a, b in zip(left_pad(kept, pad=0), (ids, mask)))


def test_rows_pickle_their_flat_tensor_once():
    import io

    flat = torch.arange(100_000, dtype=torch.int64)
    rows = Rows(flat, [25_000] * 4)
    size = len(pickle.dumps(rows))
    assert size < 1.5 * flat.numel() * 8  # a list of views pickles the whole storage once a row
    assert len(pickle.dumps(list(rows))) > 3 * flat.numel() * 8
    buf = io.BytesIO()
    torch.save(rows, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert type(back) is list and all(torch.equal(a, b) for a, b in zip(back, rows))


def test_padding_is_kept_only_where_it_costs_little_memory():
    even = Rows(torch.arange(12), [4, 4, 3, 1])
    assert even.padded() is even.padded()  # 16 padded for 12: kept
    tail = Rows(torch.arange(1_003), [1, 1, 1, 1_000])  # 4,000 padded for 1,003: made anew each time
    assert torch.equal(tail.padded(), tail.padded()) and tail.padded() is not tail.padded()


def test_only_a_one_dimensional_flat_tensor_makes_rows():
    with pytest.raises(ValueError, match="1-D"):
        Rows(torch.zeros(2, 3), [1, 1])


def test_joined_rows_are_their_elements_row_major():
    from rlgraph.rows import joined

    kept = Rows(torch.arange(5), [2, 3])
    assert joined(kept) is kept.flat
    cases = [[torch.arange(3), torch.arange(2)], [torch.ones(2, 3), torch.zeros(1, 3)],
             [torch.ones(2, 3), torch.zeros(1, 4)], [torch.tensor(1.0), torch.tensor(2.0)],
             [torch.ones(2), torch.zeros(1, 2)]]
    for rows in cases:
        assert torch.equal(joined(rows), torch.cat([r.reshape(-1) for r in rows]))


def test_rows_of_gives_any_stored_form_of_a_column_as_rows_sharing_what_it_can():
    from rlgraph.rows import rows_of

    kept = Rows(torch.tensor([1, 2, 3, 4]), [1, 3])
    kept.padded()
    uncut = rows_of(kept, torch.int64)  # neither has views yet: each makes its own when read as a list
    assert uncut is not kept and uncut.flat is kept.flat and len(uncut) == 2 and list.__len__(uncut) == 0
    assert [r.tolist() for r in uncut] == [[1], [2, 3, 4]] and list.__len__(kept) == 0
    kept.cut()
    shared = rows_of(kept, torch.int64)
    assert shared is not kept and shared.flat is kept.flat and shared[1] is kept[1]  # no copy, no new views
    # but not the kept padding, which a reader could change unseen, nor the list of lengths
    assert shared.padded() is not kept.padded() and torch.equal(shared.padded(), kept.padded())
    assert shared.lengths == kept.lengths and shared.lengths is not kept.lengths
    shared.append(torch.tensor([9]))  # the reader's list is its own
    assert len(kept) == 2 and kept.flat is not None and shared.flat is None
    as_float = rows_of(kept, torch.float32)
    assert as_float.flat.dtype == torch.float32 and [r.tolist() for r in as_float] == [[1.0], [2.0, 3.0, 4.0]]
    dense = rows_of(torch.tensor([[1, 2], [3, 4]]), torch.int64)
    assert dense.lengths == [2, 2] and [r.tolist() for r in dense] == [[1, 2], [3, 4]]
    listed = rows_of([torch.tensor([5]), [6, 7], torch.tensor([], dtype=torch.int64)], torch.int64)
    assert listed.lengths == [1, 2, 0] and listed.flat.tolist() == [5, 6, 7]
    assert rows_of([], torch.int64).lengths == [] and rows_of([], torch.int64).flat.dtype == torch.int64
    with pytest.raises(ValueError, match="1-D tensors"):
        rows_of([torch.ones(2, 2)], torch.float32)
    with pytest.raises(ValueError, match=r"\[rows, width\]"):
        rows_of(torch.ones(2, 2, 2), torch.float32)


def test_rows_cut_their_views_when_first_read_as_a_list_and_c_code_gets_them_cut():
    """The views are made at the first read as a list, whatever the read; `cut` makes them for C code
    that reads a list's items directly (torch's list arguments), and the runtime cuts a body's rows."""
    flat = torch.arange(6)

    def fresh() -> Rows:
        r = Rows(flat, [2, 0, 4])
        assert list.__len__(r) == 0 and len(r) == 3 and bool(r)  # nothing cut, the length known
        return r

    expect = [[0, 1], [], [2, 3, 4, 5]]
    reads = {
        "index": lambda r: [r[0].tolist(), r[1].tolist(), r[-1].tolist()],
        "slice": lambda r: [x.tolist() for x in r[0:3]],
        "loop": lambda r: [x.tolist() for x in r],
        "list": lambda r: [x.tolist() for x in list(r)],
        "tuple": lambda r: [x.tolist() for x in tuple(r)],
        "reversed": lambda r: [x.tolist() for x in reversed(r)][::-1],
        "unpack": lambda r: [x.tolist() for x in (lambda a, b, c: (a, b, c))(*r)],
        "copy": lambda r: [x.tolist() for x in r.copy()],
        "add": lambda r: [x.tolist() for x in r + []],
        "radd": lambda r: [x.tolist() for x in [] + r],
        "mul": lambda r: [x.tolist() for x in (r * 1)],
        "cat": lambda r: [torch.cat(r.cut()).tolist()[:2], [], torch.cat(r).tolist()[2:]],
    }
    for name, read in reads.items():
        assert read(fresh()) == expect, name
    r = fresh()
    assert r.index(r[0]) == 0 and r[0] in r
    ones = torch.tensor([5, 6, 7])  # rows of one element: their == gives one truth value
    a, b = Rows(ones, [1, 1, 1]), Rows(ones.clone(), [1, 1, 1])
    assert a == b and not a != b and list.__len__(b) == 3  # the other one is cut for the list's C code too
    assert Rows(ones, [1, 1, 1]).count(torch.tensor(6)) == 1
    assert fresh() != [] and repr(fresh()).startswith("[tensor([0, 1])")
    changed = fresh()
    changed.append(torch.tensor([7]))  # a change cuts first, then forgets the flat tensor
    assert changed.flat is None and [x.tolist() for x in changed] == expect + [[7]]
    assert Rows(flat[:0], [])._cut and len(Rows(flat[:0], [])) == 0
    with pytest.raises(ValueError, match="summing to 5"):  # checked when made, as the split was
        Rows(flat, [2, 3])
    with pytest.raises(ValueError, match="summing to 0"):
        Rows(flat, [])
    with pytest.raises(ValueError, match="smallest -1"):
        Rows(flat, [7, -1])
    # threads that race to the first read each see every row
    import threading
    many = Rows(torch.arange(50_000), [1] * 50_000)
    seen: list[int] = []
    readers = [threading.Thread(target=lambda: seen.append(sum(1 for _ in many))) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert seen == [50_000] * 4 and list.__len__(many) == 50_000
    # pickled and unpickled uncut: the flat tensor once, a plain list of views back
    import pickle
    back = pickle.loads(pickle.dumps(fresh()))
    assert type(back) is list and [x.tolist() for x in back] == expect


def test_a_body_gets_its_rows_cut_unless_it_reads_only_their_flat_tensor():
    from rlgraph.graph.plan import ColumnPlan
    from rlgraph.rows import reads_flat
    from rlgraph.runtime.invoke import to_call_value

    col = ColumnPlan(name="responses", dtype="int64", shape=["response_len"], level="sample", kind="data",
                     producer="generate", consumers=["reward"], stored=True)
    stored = Rows(torch.arange(5), [2, 3])
    given = to_call_value(col, stored, as_rows=True)
    assert list.__len__(given) == 2 and torch.cat(given).tolist() == [0, 1, 2, 3, 4]  # torch reads it directly
    assert list.__len__(to_call_value(col, stored, as_rows=True, uncut=True)) == 0

    @reads_flat
    def body(responses):
        return responses
    assert getattr(body, "__rlgraph_reads_flat__") is True
    # the built-in reward reads its rows so, and its bound method carries the mark to the binding
    from rlgraph.ops.reward.rule import RewardWorker
    from rlgraph.rows import READS_FLAT
    assert getattr(RewardWorker().compute_reward, READS_FLAT, False) is True
