"""Masked statistics, loss aggregation and per-token log-prob/entropy from logits.

Every tensor here is `[b, T]` over response tokens, right-padded; `mask` is 1 on valid tokens
and 0 on padding (bool, int or float). A row whose mask is all zero is a padding row (added to
balance data-parallel shards): it must never move a statistic or a loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlgraph.errors import ConfigError
from rlgraph.ops.names import AGG_MODES

__all__ = [
    "AGG_MODES",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "agg_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
]



def check_same_shape(fn: str, **tensors: Tensor) -> None:
    """Raise one ValueError listing every tensor whose shape differs from the first one's."""
    (first, ref), *rest = tensors.items()
    bad = [f"{name!r} has shape {tuple(t.shape)}" for name, t in rest if t.shape != ref.shape]
    if bad:
        raise ValueError(
            f"{fn}: {', '.join(bad)} but {first!r} has shape {tuple(ref.shape)}; "
            f"pass tensors of one shape [b, T] (the response tokens, right-padded)"
        )


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the tokens where `mask` is 1, over everything or along `dim`."""
    mask = mask.to(x.dtype)
    # masked_mean(x, m) = sum(x * m) / (sum(m) + 1e-8)
    if dim is None:
        return (x * mask).sum() / (mask.sum() + 1e-8)
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over all masked tokens; unbiased (Bessel's N/(N-1)) by default."""
    mean = masked_mean(x, mask)
    # var = masked_mean((x - mean)^2) * N / (N - 1),  N = sum(m)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        if n <= 1:
            raise ValueError(
                f"masked_var: the mask has {int(n.item())} valid token(s); the unbiased variance "
                f"needs at least 2 (whiten over a larger batch, or pass unbiased=False)"
            )
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise `x` to zero mean, unit variance over all masked tokens of the batch.

    With `shift_mean=False` the mean is added back: only the scale changes.
    Values at masked-out positions are transformed too; callers multiply by the mask.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    # whiten(x) = (x - mean) * rsqrt(var + 1e-8)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
) -> Tensor:
    """Reduce a per-token loss `[b, T]` to a scalar.

    Modes (N = valid tokens, S = sequences with at least one valid token):
      "token-mean":          sum_{i,t} loss*m / N
      "seq-mean-token-sum":  sum_i (sum_t loss*m) / S
      "seq-mean-token-mean": sum_i (sum_t loss*m / sum_t m) / S

    Padding rows (all-zero mask) are not counted in S, so they never dilute a seq-mean.

    Global normalisers. The training loop splits a mini-batch into micro-batches and over dp
    ranks. Taking each micro-batch's *local* mean and averaging those is wrong whenever the
    micro-batches hold different numbers of tokens. Instead the loop passes
      global_tokens = N of the whole mini-batch (all micro-batches, all dp ranks)
      global_seqs   = S of the whole mini-batch (all micro-batches, all dp ranks)
    and each call returns its local *sum* divided by the global count. Then
      sum over micro-batches and ranks of agg_loss(...) == agg_loss(whole mini-batch)
    exactly, so accumulating gradients over micro-batches and SUM-all-reducing them over
    ranks gives the gradient of the global mean. (DDP/FSDP all-reduce with AVG: multiply each
    rank's loss by the dp world size to undo the division.) "token-mean" reads only
    `global_tokens`, the seq modes only `global_seqs`; when the one a mode reads is None the
    local count is used (single micro-batch, single rank).
    """
    if mode not in AGG_MODES:
        raise ConfigError(f"agg_loss: unknown mode {mode!r}; choose one of {', '.join(AGG_MODES)}")
    check_same_shape("agg_loss", loss_mat=loss_mat, mask=mask)
    for name, value in (("global_tokens", global_tokens), ("global_seqs", global_seqs)):
        if value is not None and not value > 0:
            raise ValueError(
                f"agg_loss: {name}={value!r} must be > 0; pass the count of the whole mini-batch"
            )
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if global_tokens is None:
            return masked_mean(loss_mat, mask)
        return (loss_mat * mask).sum() / global_tokens
    seq_sums = (loss_mat * mask).sum(dim=-1)  # [b]
    tokens_per_seq = mask.sum(dim=-1)  # [b]
    if mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    else:
        seq_losses = seq_sums / (tokens_per_seq + 1e-8)
    n_seqs = global_seqs if global_seqs is not None else (tokens_per_seq > 0).sum().clamp(min=1)
    return seq_losses.sum() / n_seqs


ROWS_ELEMENTS = 1 << 24  # rows of [T, V] logits taken at once: at most this many elements (64 MB in float32)


def _row_blocks(logits: Tensor) -> int:
    """How many rows of `logits` ([b, T, V]) to take at once: as many as keep a temporary of the
    block's size under `ROWS_ELEMENTS` (one row of a long response with a large vocabulary)."""
    per_row = max(1, logits[0].numel()) if logits.shape[0] else 1
    return max(1, ROWS_ELEMENTS // per_row)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: `[b, T, V] -> [b, T]`.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, over blocks of rows whose temporary softmax
    stays under `ROWS_ELEMENTS` elements (one row at a time for long responses with a large
    vocabulary; the whole batch for short ones, without a loop over rows).
    """
    step = _row_blocks(logits)
    out = []
    for block in logits.split(step):
        p = torch.softmax(block, dim=-1)
        out.append(torch.logsumexp(block, dim=-1) - (p * block).sum(dim=-1))
    return torch.cat(out) if out else logits.new_zeros(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log softmax(logits)[token_id] for each position: `[b, T, V], [b, T] -> [b, T]`.

    Over blocks of rows whose temporary stays under `ROWS_ELEMENTS` elements. In float32/64
    gather the chosen logit and subtract logsumexp (no full log_softmax is kept); in bf16/fp16
    logsumexp is not accurate enough, so take log_softmax of the block and gather from it.
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"logprobs_from_logits: token_ids has shape {tuple(token_ids.shape)} but logits has "
            f"shape {tuple(logits.shape)}; token_ids must be logits.shape[:-1]"
        )
    step = _row_blocks(logits)
    out = []
    for block, ids in zip(logits.split(step), token_ids.split(step)):
        ids = ids.unsqueeze(-1)
        if block.dtype in (torch.float32, torch.float64):
            out.append(block.gather(-1, ids).squeeze(-1) - torch.logsumexp(block, dim=-1))
        else:
            out.append(torch.log_softmax(block, dim=-1).gather(-1, ids).squeeze(-1))
    return torch.cat(out) if out else logits.new_zeros(logits.shape[:-1])
