"""The rollout engine against the trainer: how far their log-probs disagree, and truncated
importance sampling to correct for it.

The engine (vLLM, or HF generate) samples a response token by token and reports each token's
log-prob under its own numerics; the trainer recomputes them (`old_log_probs`). They differ a
little (kernels, precision, batch shapes), so the samples are slightly off-policy for the
trainer. Two tools, as in verl:

- `rollout_probs_diff`: ``|p_train - p_rollout|`` over valid tokens, with ``p = exp(logp)``;
  its mean and max are the step's ``rollout_probs_diff_mean`` / ``_max`` metrics;
- `truncated_is_weights`: per-token weights ``min(exp(old_logp - rollout_logp), cap)``
  (truncated importance sampling, Yao et al. 2025); the policy loss of each token is multiplied
  by its weight (``policy_loss(..., is_weights=...)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlgraph.ops.algos.core import check_same_shape, masked_mean

__all__ = ["ProbsDiff", "rollout_probs_diff", "truncated_is_weights"]


class ProbsDiff(NamedTuple):
    mean: float  # masked mean of |p_train - p_rollout| over valid tokens
    max: float  # its maximum over valid tokens (0 when there are none)


def rollout_probs_diff(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> ProbsDiff:
    """How far the trainer's token probabilities are from the rollout engine's, over valid tokens."""
    check_same_shape("rollout_probs_diff", old_logp=old_logp, rollout_logp=rollout_logp, response_mask=response_mask)
    # |p_train - p_rollout| per token
    diff = (torch.exp(old_logp.float()) - torch.exp(rollout_logp.float())).abs()
    valid = response_mask.bool()
    return ProbsDiff(float(masked_mean(diff, response_mask)), float(diff[valid].max()) if valid.any() else 0.0)


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """``min(exp(old_logp - rollout_logp), cap)`` per token (no gradient): the truncated importance
    weight of each sampled token, trainer over engine."""
    check_same_shape("truncated_is_weights", old_logp=old_logp, rollout_logp=rollout_logp)
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap={cap!r} must be > 0")
    with torch.no_grad():
        # log w = log pi_train(a) - log pi_rollout(a), clamped to +-20 so exp() stays finite
        log_w = torch.clamp(old_logp - rollout_logp, min=-20.0, max=20.0)
        # w = min(exp(log w), cap)
        return torch.clamp(torch.exp(log_w), max=cap)

