"""Micro-batches by a token budget, and a batch's rows balanced across data-parallel ranks by length.

With skewed response lengths (8..1,024 tokens), micro-batches of a fixed number of rows are either
too small for short rows or out of memory for long ones, and one rank holding the long rows
makes the others wait at every gradient all-reduce. verl's answer (``use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu``, and ``balance_batch``), which rlgraph follows:

- `token_micro_batches`: split a mini-batch's rows into the fewest parts whose token sums stay
  within the budget (at least ``ceil(total / budget)``; more where rows do not fit), balanced by
  longest-first placement on the lightest part. A row longer than the budget gets a part of its
  own (it cannot be split). Every rank uses the largest part count of any rank
  (`agree_on_count`): under FSDP2 every micro-batch's forward is a collective.
- `balance_across_ranks`: before the update, the ranks exchange their rows (small integer tensors:
  token ids, masks, advantages) and each keeps an equal number of rows with about equal token sums.
  The losses are normalised by global counts (`rlgraph.ops.train.engine`), so which rank computes a
  row does not change a one-mini-batch update beyond float rounding.

Both partitions are deterministic: every rank computes the same one from the same lengths.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["token_micro_batches", "balanced_parts", "agree_on_count", "balance_across_ranks"]


def balanced_parts(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """`k` parts of the indices of `lengths` with about equal sums: longest first onto the lightest part
    (with `equal_size`, the lightest part that is not yet full; sizes differ by at most one).
    Parts keep ascending index order; none is empty when ``k <= len(lengths)``."""
    n = len(lengths)
    if k < 1:
        raise ValueError(f"balanced_parts needs k >= 1, got {k}")
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    caps = [n // k + (1 if p < n % k else 0) for p in range(k)] if equal_size else [n] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]  # (sum, part)
    for i in order:
        held: list[tuple[int, int]] = []
        total, p = heapq.heappop(heap)
        while len(parts[p]) >= caps[p]:  # full: try the next lightest
            held.append((total, p))
            total, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (total + int(lengths[i]), p))
        for h in held:
            heapq.heappush(heap, h)
    if not equal_size:  # an empty part only when there are fewer rows than parts
        parts = [q for q in parts if q] or [[]]
    return [sorted(q) for q in parts]


def token_micro_batches(lengths: Sequence[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Positions of `lengths` in micro-batches of at most `budget` tokens each (a longer row alone),
    at least `min_count` of them (when there are that many rows)."""
    if budget < 1:
        raise ValueError(f"token_micro_batches needs a budget >= 1, got {budget}")
    n = len(lengths)
    if n == 0:
        return []
    total = sum(int(x) for x in lengths)
    k = min(n, max(min_count, -(-total // budget), 1))
    while True:
        parts = balanced_parts(lengths, k)
        over = [p for p in parts if len(p) > 1 and sum(int(lengths[i]) for i in p) > budget]
        if not over or k >= n:
            return parts
        k += 1


def agree_on_count(count: int, world_size: int) -> int:
    """The largest `count` over the ranks (every rank must run as many micro-batches under FSDP2)."""
    if world_size == 1:
        return count
    import torch.distributed as dist

    from rlgraph.ops.train.engine.dist import collective_device

    t = torch.tensor([count], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def balance_across_ranks(batch: Mapping[str, Tensor], lengths: Tensor, rank: int,
                         world_size: int) -> tuple[dict[str, Tensor], dict[str, float]]:
    """This rank's rows after every rank's rows are pooled and split into `world_size` equal-count parts
    with about equal token sums. `lengths`: this rank's rows' token counts. Every rank must hold the
    same number of rows (the runtime's padded shares do). Returns the rows and the imbalance before and
    after (max over ranks / mean of the token sums)."""
    if world_size == 1:
        return dict(batch), {}
    import torch.distributed as dist

    from rlgraph.ops.train.engine.dist import collective_device

    dev = collective_device()  # NCCL moves GPU tensors only
    rows = int(lengths.shape[0])
    table = torch.zeros(world_size, dtype=torch.int64, device=dev)
    table[rank] = rows
    dist.all_reduce(table)
    if len(set(table.tolist())) > 1:  # raised on every rank at once: none is left waiting in a collective
        raise ValueError(f"cannot balance the batch across ranks: they hold different numbers of rows "
                         f"{table.tolist()}; every rank must hold the same number (the runtime pads the batch so)")
    lengths = lengths.to(dev)
    all_lengths = [torch.zeros_like(lengths) for _ in range(world_size)]
    dist.all_gather(all_lengths, lengths.contiguous())
    all_lengths = [t.cpu() for t in all_lengths]
    pooled_lengths = torch.cat(all_lengths).tolist()
    parts = balanced_parts(pooled_lengths, world_size, equal_size=True)
    # equal_size keeps every part at `rows` rows (same count on every rank, so whole mini-batches)
    mine = torch.tensor(parts[rank], dtype=torch.long)
    out: dict[str, Tensor] = {}
    for key in sorted(batch):
        local = batch[key].to(dev)
        width = torch.tensor([local.shape[1] if local.dim() > 1 else 0], dtype=torch.int64, device=dev)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        padded = local
        if local.dim() > 1 and local.shape[1] < int(width):
            pad = local.new_zeros((rows, int(width) - local.shape[1], *local.shape[2:]))
            padded = torch.cat([local, pad], dim=1)
        gathered = [torch.zeros_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded.contiguous())
        out[key] = torch.cat(gathered)[mine.to(dev)].cpu()
    sums_before = [int(t.sum()) for t in all_lengths]
    sums_after = [sum(int(pooled_lengths[i]) for i in p) for p in parts]
    mean = max(sum(sums_before) / world_size, 1e-9)
    return out, {"rank_tokens_imbalance_before": max(sums_before) / mean,
                 "rank_tokens_imbalance_after": max(sums_after) / mean}
