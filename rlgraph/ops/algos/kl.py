"""KL between the policy and the reference: per-token estimators, the reward penalty, the
actor's KL loss, and the fixed/adaptive KL coefficient controllers.

Estimators follow Schulman's "Approximating KL Divergence" (k1, k2, k3) with
d = logp - ref_logp, samples drawn from the policy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlgraph.errors import ConfigError
from rlgraph.ops.algos.core import agg_loss, check_same_shape, masked_mean
from rlgraph.ops.names import KL_KINDS

__all__ = [
    "KL_KINDS",
    "KLPenaltyResult",
    "FixedKLController",
    "AdaptiveKLController",
    "kl_penalty",
    "apply_kl_penalty",
    "kl_loss",
]



class KLPenaltyResult(NamedTuple):
    token_level_rewards: Tensor  # [b, T] scores - kl_coef * kl, 0 on padding
    current_kl: float  # mean over real samples of each sample's masked-mean KL


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate `[b, T]` (unmasked) of the policy from the reference."""
    check_same_shape("kl_penalty", logp=logp, ref_logp=ref_logp)
    # d = log pi(a) - log pi_ref(a)
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        # k1 = d
        return d
    if kind == "abs":
        # |d|
        return d.abs()
    if kind in ("mse", "k2"):
        # k2 = d^2 / 2
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        # The +-20 clamp never changes a returned value (|d| > 20 gives k3 > 10 either way) but
        # keeps exp() finite, so the clamped branch's gradient is 0 instead of inf * 0 = nan.
        d = d.clamp(-20.0, 20.0)
        # k3 = exp(-d) - 1 + d, clamped to [-10, 10]
        return (torch.exp(-d) - 1 + d).clamp(-10.0, 10.0)
    raise ConfigError(f"kl_penalty: unknown kind {kind!r}; choose one of {', '.join(KL_KINDS)}")


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_probs: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> KLPenaltyResult:
    """In-reward KL (PPO-RLHF): r_t = score_t - kl_coef * kl_t on valid tokens, 0 on padding.

    current_kl is verl's: each sample's masked-mean KL, averaged over samples. Padding rows
    (all-zero mask) are left out of that average, so they cannot pull it towards 0; with no
    padding rows this is exactly verl's number. Feed it to the controller's `update`.
    """
    check_same_shape(
        "apply_kl_penalty",
        token_level_scores=token_level_scores,
        old_log_probs=old_log_probs,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    mask = response_mask.to(old_log_probs.dtype)
    kl = kl_penalty(old_log_probs, ref_log_prob, kind) * mask  # [b, T]
    # r_t = s_t - beta * kl_t
    token_level_rewards = (token_level_scores - kl_coef * kl) * mask
    per_sample_kl = masked_mean(kl, mask, dim=-1)  # [b]
    real = mask.sum(dim=-1) > 0
    current_kl = per_sample_kl[real].mean().item() if real.any() else 0.0
    return KLPenaltyResult(token_level_rewards=token_level_rewards, current_kl=current_kl)


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: str = "low_var_kl",
    agg_mode: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
) -> Tensor:
    """The actor's KL loss (GRPO): agg_loss(kl_penalty(logp, ref_logp, kind)); scalar."""
    kl = kl_penalty(logp, ref_logp, kind)
    return agg_loss(kl, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)


def _check_state(cls: str, state: dict) -> float:
    if not isinstance(state, dict) or state.get("type") != cls:
        got = state.get("type") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{cls}.load_state_dict: the state is from {got!r}, not {cls!r}; "
                         f"the checkpoint's algorithm.kl_ctrl must match the config's")
    value = state.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}.load_state_dict: 'value' must be a number, got {value!r}")
    return float(value)


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef={kl_coef!r} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"type": "FixedKLController", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _check_state("FixedKLController", state)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, as in verl and TRL).

    Moves the coefficient so that the measured KL tracks `target_kl`, by at most
    +-20% * n_steps / horizon per update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        problems = []
        if init_kl_coef < 0:
            problems.append(f"init_kl_coef={init_kl_coef!r} must be >= 0")
        if not target_kl > 0:
            problems.append(f"target_kl={target_kl!r} must be > 0")
        if not horizon > 0:
            problems.append(f"horizon={horizon!r} must be > 0")
        if problems:
            raise ValueError("AdaptiveKLController: " + "; ".join(problems))
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """`current_kl` from `apply_kl_penalty`; `n_steps` = samples in the batch (as verl)."""
        # e = clip(KL / KL_target - 1, -0.2, 0.2)
        proportional_error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        # beta <- beta * (1 + e * n_steps / horizon)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> dict:
        return {"type": "AdaptiveKLController", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore the coefficient; target_kl and horizon stay as configured."""
        self.value = _check_state("AdaptiveKLController", state)
