"""The rollout engine against the trainer: how far their log-probs disagree, and the corrections
for samples the trainer's policy did not generate (engine numerics, or an older policy).

The engine (vLLM, or HF generate) samples a response token by token and reports each token's
log-prob under its own numerics; the trainer recomputes them (`old_log_probs`). They differ a
little (kernels, precision, batch shapes), so the samples are slightly off-policy for the
trainer. Two tools, as in verl:

- `rollout_probs_diff`: ``|p_train - p_rollout|`` over valid tokens, with ``p = exp(logp)``;
  its mean and max are the step's ``rollout_probs_diff_mean`` / ``_max`` metrics;
- `truncated_is_weights`: per-token weights ``min(exp(old_logp - rollout_logp), cap)``
  (truncated importance sampling, Yao et al. 2025); the policy loss of each token is multiplied
  by its weight (``policy_loss(..., is_weights=...)``).

With asynchronous training (``trainer.max_staleness >= 1``) the samples come from a policy up to
k updates older than the trained one. ``old_log_probs`` is then recomputed by the current policy
before the update: the *proximal* policy of decoupled PPO (Hilton et al. 2022; AReaL, Fu et al.
2025), and the behaviour policy's are ``rollout_log_probs``:

- `decoupled_weights`: the PPO ratio is clipped against the proximal policy, and each token's
  loss is weighted by the behaviour importance weight ``exp(old_logp - rollout_logp)``; tokens
  whose weight exceeds ``cap`` leave the loss (AReaL's ``behav_imp_weight_cap``: they are masked
  out, not truncated);
- `truncated_is_weights`: the same weight truncated at ``cap`` instead (TIS).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlgraph.ops.algos.core import check_same_shape, masked_mean

__all__ = ["ProbsDiff", "decoupled_weights", "rollout_probs_diff", "truncated_is_weights"]


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


def decoupled_weights(prox_logp: Tensor, behav_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's behaviour weights and token mask (no gradient): ``w = exp(prox_logp -
    behav_logp)`` per token, and ``keep = w <= cap``. The caller weights each token's clipped
    loss by ``w`` and removes the tokens with ``keep == 0`` from the loss mask."""
    check_same_shape("decoupled_weights", prox_logp=prox_logp, behav_logp=behav_logp)
    if not cap > 1:
        raise ValueError(f"decoupled_weights: cap={cap!r} must be > 1 (a weight of 1 is on-policy)")
    with torch.no_grad():
        # log w = log pi_prox(a) - log pi_behav(a), clamped to +-20 so exp() stays finite
        log_w = torch.clamp(prox_logp.float() - behav_logp.float(), min=-20.0, max=20.0)
        w = torch.exp(log_w)
        keep = w <= cap
        # dropped tokens get weight 0 as well, so a caller that forgets the mask still drops them
        return torch.where(keep, w, torch.zeros_like(w)), keep
