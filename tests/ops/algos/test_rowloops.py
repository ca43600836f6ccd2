"""The vectorised helpers give what the per-row loops they replaced gave (benchmarks/rowloops.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import rowloops
from rlgraph.ops.algos import core
from rlgraph.ops.algos.core import entropy_from_logits, logprobs_from_logits
from rlgraph.ops.rollout.parts import cut_lengths, response_columns
from rlgraph.ops.train.sequences import pack, repack
from rlgraph.rows import left_pad


@pytest.fixture(scope="module")
def d():
    return rowloops.rows(200, seed=3)


def test_repack_is_split_then_pack(d):
    want = pack(*rowloops.split_rows_loop(d["input_ids"], d["attention_mask"], d["rlen"]), 7)
    got = repack(d["input_ids"], d["attention_mask"], d["rlen"], 7)
    assert (got.prompt_width, got.response_width) == (want.prompt_width, want.response_width)
    for a, b in zip(got[:4], want[:4]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("budget", [core.ROWS_ELEMENTS, 1, 16 * 64 * 3])  # whole batch, one row, blocks of 3
def test_log_probs_and_entropy_match_the_row_loop_in_any_block_size(d, budget, monkeypatch):
    monkeypatch.setattr(core, "ROWS_ELEMENTS", budget)
    torch.testing.assert_close(logprobs_from_logits(d["logits"], d["ids"]),
                               rowloops.logprobs_loop(d["logits"], d["ids"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy_from_logits(d["logits"]), rowloops.entropy_loop(d["logits"]),
                               rtol=0, atol=1e-6)


def test_blocks_keep_the_temporary_under_the_budget():
    logits = torch.zeros(10, 100, 1000)  # 100k elements per row
    assert core._row_blocks(logits) == core.ROWS_ELEMENTS // 100_000
    assert core._row_blocks(torch.zeros(2, 4096, 152_000)) == 1  # a long response, a large vocabulary


@pytest.mark.parametrize("with_log_probs", [True, False])
def test_response_columns_match_the_row_loop(d, with_log_probs):
    lp = d["log_probs"] if with_log_probs else None
    got = response_columns(d["prompts"], d["responses"], d["padding"], lp)
    want = rowloops.response_columns_loop(d["prompts"], d["responses"], d["padding"], lp)
    assert list(got) == list(want)
    for k in want:
        assert len(got[k]) == len(want[k])
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[k], want[k])), k
    assert response_columns([], [], [], None) == {k: [] for k in want}


def test_left_pad_matches_the_row_loop(d):
    for pad in (0, 5):
        got, want = left_pad(d["prompts"], pad), rowloops.left_pad_loop(d["prompts"], pad)
        assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.long for a, b in zip(got, want))
    ids, mask = left_pad([torch.tensor([7], dtype=torch.int32)], 0)  # any integer dtype in, long out
    assert ids.tolist() == [[7]] and mask.tolist() == [[1]] and ids.dtype == torch.long


@pytest.mark.parametrize("stop", [{1, 2}, {1}, set(), {None, 3}, {999}])
def test_cut_lengths_match_the_row_loop(d, stop):
    got = [row[:k] for row, k in zip(d["generated"], cut_lengths(d["generated"], stop))]
    want = rowloops.cut_loop(d["generated"], stop)
    assert [r.tolist() for r in got] == [r.tolist() for r in want]
    assert cut_lengths(torch.tensor([[5, 1, 1], [1, 5, 5], [5, 5, 5]]), {1}) == [2, 1, 3]
    assert cut_lengths(torch.zeros(0, 4, dtype=torch.long), {1}) == []


def test_converting_per_row_outputs_gives_what_the_row_loop_gives(d):
    from rlgraph.runtime.invoke import _convert

    args = rowloops._convert_args(d["responses"])
    got = _convert(*args)
    assert all(a is b for a, b in zip(got, d["responses"]))  # already long tensors: taken as they are
    as_int = [r.int() for r in d["responses"]]
    got = _convert(*args[:3], as_int, *args[4:])
    want = rowloops.convert_loop(as_int, torch.long)
    assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.long for a, b in zip(got, want))
    got = _convert(*args[:3], [r.tolist() for r in d["responses"]], *args[4:])  # lists become tensors
    assert all(torch.equal(a, b) and a.dtype == torch.long for a, b in zip(got, d["responses"]))
