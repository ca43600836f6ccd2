"""How transformers generation splits a call's groups into micro-batches (`parts.micro_batches`)."""

import torch

from rlgraph.ops.rollout.parts import micro_batches


def _groups(prompt_lens, n=2):
    prompts = [torch.ones(length, dtype=torch.long) for length in prompt_lens for _ in range(n)]
    groups = [list(range(i * n, (i + 1) * n)) for i in range(len(prompt_lens))]
    return groups, prompts


def test_a_fixed_size_counts_groups():
    groups, prompts = _groups([3] * 5)
    assert [len(b) for b in micro_batches(groups, prompts, 2, 10**9, 4)] == [2, 2, 1]


def test_size_zero_fills_the_token_budget_in_order():
    groups, prompts = _groups([3, 3, 3, 3, 3])  # each group: 2 rows x (3 + 5) = 16 tokens
    batches = micro_batches(groups, prompts, 0, 48, 5)
    assert [len(b) for b in batches] == [3, 2]
    assert [g for b in batches for g in b] == groups  # every group once, in order


def test_a_long_prompt_widens_the_whole_batch():
    groups, prompts = _groups([2, 2, 10, 2])  # padded to the longest prompt: 10 + 2 = 12 per row
    batches = micro_batches(groups, prompts, 0, 40, 2)
    # [2, 2] -> 4 rows x 4 = 16; adding the 10-token prompt -> 6 rows x 12 = 72 > 40: a new batch
    assert [len(b) for b in batches] == [2, 1, 1]
    assert all((sum(len(g) for g in b) * (max(len(prompts[i]) for g in b for i in g) + 2) <= 40) or len(b) == 1
               for b in batches)


def test_a_group_larger_than_the_budget_still_gets_its_own_call():
    groups, prompts = _groups([50, 50], n=4)
    assert [len(b) for b in micro_batches(groups, prompts, 0, 16, 8)] == [1, 1]


def test_the_whole_grpo_example_batch_is_one_call_by_default():
    groups, prompts = _groups([8] * 64, n=8)  # 64 prompts x 8 samples, 8-token prompts, 4 new tokens
    assert len(micro_batches(groups, prompts, 0, 16384, 4)) == 1
