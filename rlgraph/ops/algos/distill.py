"""Distillation losses over the teacher's top-k distribution (GKD's generalised Jensen-Shannon divergence).

On-policy distillation with a dense signal: at every response token the student sampled, the
teacher's distribution over the next token is the target. A teacher op writes its `k` most likely
tokens per position and their log-probs (``teacher_topk_ids``, ``teacher_topk_log_probs``), and
the update computes the student's log-probs of the same ids. Both distributions are then compared
over k + 1 outcomes: the k tokens and one *tail* holding the rest of the vocabulary
(``1 - sum`` of the k probabilities). That coarsening is exact bookkeeping, not a renormalisation:
each probability is the model's own, the divergence is a lower bound of the full-vocabulary one
(data processing), and equals it when k is the vocabulary.

The divergence is GKD's (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", eq. 1; TRL's ``GKDTrainer.generalized_jsd_loss``), with
beta as in TRL:

    beta = 0:        KL(T || S) = sum_v T(v) (log T(v) - log S(v))          (forward KL)
    beta = 1:        KL(S || T) = sum_v S(v) (log S(v) - log T(v))          (reverse KL)
    0 < beta < 1:    M = beta T + (1 - beta) S,
                     JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)

per token, then reduced over the response tokens with the update's ``loss_agg_mode`` (`agg_loss`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlgraph.ops.algos.core import agg_loss, check_same_shape

__all__ = ["NO_TOKEN", "TAIL_FLOOR", "with_tail", "generalized_jsd", "top_k_distill_loss", "usable_ids",
           "drop_unusable"]

# a tail probability below this counts as this. 1 - sum(p) over float32 probabilities is only good to about 1e-7
# per token summed, so when k covers the vocabulary both tails are rounding noise: floored well above it they are
# equal, carry no gradient (the clamp), and the noise cannot be divided by a near-zero student tail at beta=0
TAIL_FLOOR = 1e-5
NO_TOKEN = -1  # a top-k slot with no token (an engine gave fewer than k, or the student's vocabulary lacks it)


def with_tail(log_probs: Tensor) -> Tensor:
    """``[..., k]`` log-probs of k distinct tokens -> ``[..., k + 1]``: the same and ``log(1 - sum p)``,
    the rest of the vocabulary's probability, floored at `TAIL_FLOOR`."""
    tail = (1.0 - log_probs.exp().sum(dim=-1, keepdim=True)).clamp(min=TAIL_FLOOR).log()
    return torch.cat([log_probs, tail], dim=-1)


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """Per-position divergence between two distributions given as log-probs over the last dimension
    (each sums to 1): forward KL at beta=0, reverse KL at beta=1, GKD's JSD_beta between."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta={beta!r} must be in [0, 1] (0: forward KL, 1: reverse KL)")
    if beta == 0.0:  # KL(T || S)
        return (teacher.exp() * (teacher - student)).sum(dim=-1)
    if beta == 1.0:  # KL(S || T)
        return (student.exp() * (student - teacher)).sum(dim=-1)
    # log M = log(beta T + (1 - beta) S)
    mix = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), dim=0)
    kl_t = (teacher.exp() * (teacher - mix)).sum(dim=-1)  # KL(T || M)
    kl_s = (student.exp() * (student - mix)).sum(dim=-1)  # KL(S || M)
    return beta * kl_t + (1.0 - beta) * kl_s


def usable_ids(ids: Tensor, teacher_log_probs: Tensor, vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The teacher's top-k as the student can score them: ids to gather (``NO_TOKEN`` slots and ids past the
    student's vocabulary, which a teacher with a larger embedding table may give, replaced by 0), the
    teacher's log-probs with those slots at -1e4 (no probability: their mass goes to the teacher's tail),
    and the mask of usable slots (apply it to the student's gathered log-probs with `drop_unusable`)."""
    ok = (ids >= 0) & (ids < vocab_size)
    return ids.where(ok, 0), teacher_log_probs.where(ok, -1e4), ok


def drop_unusable(student_log_probs: Tensor, ok: Tensor) -> Tensor:
    """The student's log-probs at `usable_ids`' ids with the unusable slots at -1e4 (no probability)."""
    return student_log_probs.where(ok, -1e4)


def top_k_distill_loss(student_topk_log_probs: Tensor, teacher_topk_log_probs: Tensor, response_mask: Tensor,
                       beta: float = 0.5, agg_mode: str = "token-mean", global_tokens: int | float | None = None,
                       global_seqs: int | float | None = None) -> tuple[Tensor, Tensor]:
    """The aggregated loss and the per-token divergence ``[b, T]`` between the student's and the teacher's
    distributions over the teacher's top-k tokens plus the tail (`with_tail`, `generalized_jsd`).
    Both inputs are ``[b, T, k]`` log-probs of the same ids, normalised over the whole vocabulary."""
    check_same_shape("top_k_distill_loss", student_topk_log_probs=student_topk_log_probs,
                     teacher_topk_log_probs=teacher_topk_log_probs)
    if student_topk_log_probs.shape[:-1] != response_mask.shape:
        raise ValueError(f"top_k_distill_loss: log-probs {tuple(student_topk_log_probs.shape)} do not match "
                         f"response_mask {tuple(response_mask.shape)} in their first two dimensions")
    per_token = generalized_jsd(with_tail(student_topk_log_probs.float()), with_tail(teacher_topk_log_probs.float()),
                                beta)
    loss = agg_loss(per_token, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, per_token
