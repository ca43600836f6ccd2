"""Token-budget micro-batches and equal-count length balancing: budgets held, every row placed once."""

import random

import pytest

from rlgraph.ops.train.engine.balance import balanced_parts, token_micro_batches


def _placed_once(parts, n):
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))


def test_micro_batches_fit_the_budget_and_are_as_few_as_it_allows():
    lengths = [8, 1024, 30, 500, 12, 700, 64, 9, 300, 16]
    parts = token_micro_batches(lengths, budget=1100)
    _placed_once(parts, len(lengths))
    assert all(sum(lengths[i] for i in p) <= 1100 for p in parts)
    assert len(parts) == -(-sum(lengths) // 1100)  # the fewest possible here


def test_a_row_longer_than_the_budget_gets_a_micro_batch_alone():
    parts = token_micro_batches([5, 50, 5, 5], budget=20)
    assert [1] in parts
    assert all(sum([5, 50, 5, 5][i] for i in p) <= 20 for p in parts if p != [1])


def test_min_count_raises_the_number_of_micro_batches():
    assert len(token_micro_batches([3, 3, 3, 3], budget=100, min_count=3)) == 3
    assert len(token_micro_batches([3, 3], budget=100, min_count=5)) == 2  # never more than rows


@pytest.mark.parametrize("seed", range(5))
def test_equal_size_parts_balance_skewed_lengths(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([8, 16, 32, 1024]) + rng.randrange(8) for _ in range(32)]
    parts = balanced_parts(lengths, 4, equal_size=True)
    _placed_once(parts, 32)
    assert [len(p) for p in parts] == [8, 8, 8, 8]
    sums = [sum(lengths[i] for i in p) for p in parts]
    contiguous = [sum(lengths[k * 8:(k + 1) * 8]) for k in range(4)]  # the runtime's contiguous shares
    assert max(sums) <= max(contiguous)  # never worse than the contiguous shares
    assert max(sums) <= sum(lengths) / 4 + max(lengths)  # within one row of the mean
    assert parts == balanced_parts(lengths, 4, equal_size=True)  # deterministic: every rank computes the same


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget >= 1"):
        token_micro_batches([1], 0)
    with pytest.raises(ValueError, match="k >= 1"):
        balanced_parts([1], 0)
    assert token_micro_batches([], 10) == []
