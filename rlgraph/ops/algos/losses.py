"""PPO losses: the clipped (and dual-clipped) policy loss and the clipped value loss.

Per-token tensors are `[b, T]` over response tokens; `response_mask` is 1 on valid tokens.
Losses are reduced with `agg_loss`; pass `global_tokens`/`global_seqs` when the batch is one
micro-batch of a larger mini-batch (see `agg_loss` for the contract).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlgraph.ops.algos.core import agg_loss, check_same_shape, masked_mean
from rlgraph.ops.names import LOSS_MODES

__all__ = ["LOSS_MODES", "PolicyLossResult", "ValueLossResult", "gspo_policy_loss", "policy_loss", "value_loss"]



class PolicyLossResult(NamedTuple):
    loss: Tensor  # [] aggregated with agg_loss; backprop this
    pg_losses: Tensor  # [b, T] per-token loss after clipping and dual clipping
    clipfrac: Tensor  # [] fraction of valid tokens where the ratio clip was active
    clipfrac_lower: Tensor  # [] fraction of valid tokens where the dual clip (A < 0) was active
    approx_kl: Tensor  # [] masked mean of -log(ratio), an estimate of KL(old || new)


class ValueLossResult(NamedTuple):
    loss: Tensor  # [] aggregated with agg_loss; backprop this
    vf_losses: Tensor  # [b, T] per-token 0.5 * max(unclipped, clipped) squared error
    vf_clipfrac: Tensor  # [] fraction of valid tokens where the clipped error was the larger


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    agg_mode: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossResult:
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO, `clip_ratio_high`) and dual clip
    (Ye et al. 2020, `clip_ratio_c`) for negative advantages. `is_weights` (``[b, T]``, e.g.
    `truncated_is_weights`) multiply each token's loss after clipping.

    Parameter names are the `actor.*` config keys: eps_low = `clip_ratio_low`,
    eps_high = `clip_ratio_high` (defaults to eps_low: a symmetric clip), c = `clip_ratio_c`.
    approx_kl is the masked mean of -log_ratio (k1 with samples from the old policy, verl's
    `ppo_kl`): unbiased, can be negative on a small batch.
    """
    check_same_shape(
        "policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    problems = []
    if not 0 <= clip_ratio_low < 1:
        problems.append(f"clip_ratio_low={clip_ratio_low!r} must be in [0, 1)")
    if not clip_ratio_high >= 0:
        problems.append(f"clip_ratio_high={clip_ratio_high!r} must be >= 0")
    if not clip_ratio_c >= 1.0:
        problems.append(f"clip_ratio_c={clip_ratio_c!r} must be >= 1 (it bounds the ratio for A < 0 from above)")
    if problems:
        raise ValueError("policy_loss: " + "; ".join(problems))

    # log r = log pi(a) - log pi_old(a), clamped to +-20 so exp() stays finite
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    # r = pi(a) / pi_old(a)
    ratio = torch.exp(log_ratio)
    # L1 = -A * r
    pg_losses1 = -advantages * ratio
    # L2 = -A * clip(r, 1 - eps_low, 1 + eps_high)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # L_clip = max(L1, L2)
    clip_pg_losses = torch.maximum(pg_losses1, pg_losses2)
    # L3 = -A * c
    pg_losses3 = -advantages * clip_ratio_c
    # for A < 0: L = min(L_clip, L3)
    dual_clip_pg_losses = torch.minimum(clip_pg_losses, pg_losses3)
    pg_losses = torch.where(advantages < 0, dual_clip_pg_losses, clip_pg_losses)
    if is_weights is not None:
        check_same_shape("policy_loss", logp=logp, is_weights=is_weights)
        # L = w * L (importance weight of the sampled token, no gradient through it)
        pg_losses = pg_losses * is_weights.detach()

    loss = agg_loss(pg_losses, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses1).to(logp.dtype), response_mask)
        dual_clipped = (clip_pg_losses > pg_losses3) & (advantages < 0)
        clipfrac_lower = masked_mean(dual_clipped.to(logp.dtype), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLossResult(
        loss=loss, pg_losses=pg_losses, clipfrac=clipfrac, clipfrac_lower=clipfrac_lower, approx_kl=approx_kl
    )


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float | None = 4e-4,
    global_seqs: int | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossResult:
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization), as verl defines it: one
    importance ratio per sequence, the geometric mean of its token ratios, clipped per sequence.

    s_i = exp(mean_t log r_{i,t}) over the valid tokens of sequence i; each token carries
    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)] (the same value s_i, with the gradient of the token's
    own log-prob), and L = max(-A * s, -A * clip(s, 1 - eps_low, 1 + eps_high)), aggregated
    "seq-mean-token-mean" whatever actor.loss_agg_mode says (verl does the same). No dual clip.
    The paper's clip ranges are tiny (3e-4, 4e-4) because the ratio is a per-token geometric mean.
    """
    check_same_shape(
        "gspo_policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if not (0 <= clip_ratio_low < 1 and clip_ratio_high >= 0):
        raise ValueError(f"gspo_policy_loss: clip_ratio_low={clip_ratio_low!r} must be in [0, 1) and "
                         f"clip_ratio_high={clip_ratio_high!r} >= 0")
    mask = response_mask.to(logp.dtype)
    # log r_t = log pi(y_t) - log pi_old(y_t)
    log_ratio = logp - old_logp
    # log s_i = sum_t m_t log r_t / |y_i|   (a row without valid tokens: 0)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    # log s_{i,t} = log pi(y_t) - sg[log pi(y_t)] + sg[log s_i]; clamped at 10 so exp() stays finite
    token_log_ratio = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(token_log_ratio)
    # L1 = -A * s ; L2 = -A * clip(s, 1 - eps_low, 1 + eps_high) ; L = max(L1, L2)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if is_weights is not None:
        check_same_shape("gspo_policy_loss", logp=logp, is_weights=is_weights)
        pg_losses = pg_losses * is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", global_seqs=global_seqs)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses1).to(logp.dtype), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLossResult(loss=loss, pg_losses=pg_losses, clipfrac=clipfrac,
                            clipfrac_lower=torch.zeros_like(clipfrac), approx_kl=approx_kl)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    agg_mode: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
) -> ValueLossResult:
    """Clipped value loss: the new value may not move more than eps = `cliprange_value` (the
    `critic.*` config key) from the old one to lower the loss (the pessimistic max of the
    clipped and unclipped errors)."""
    check_same_shape(
        "value_loss", values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    if not cliprange_value >= 0:
        raise ValueError(f"value_loss: cliprange_value={cliprange_value!r} must be >= 0")
    # v_clip = clip(v, v_old - eps, v_old + eps)
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    # (v - R)^2
    vf_losses1 = (values - returns) ** 2
    # (v_clip - R)^2
    vf_losses2 = (values_clipped - returns) ** 2
    # L_V = 0.5 * max((v - R)^2, (v_clip - R)^2)
    vf_losses = 0.5 * torch.maximum(vf_losses1, vf_losses2)
    loss = agg_loss(vf_losses, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(values.dtype), response_mask)
    return ValueLossResult(loss=loss, vf_losses=vf_losses, vf_clipfrac=vf_clipfrac)
