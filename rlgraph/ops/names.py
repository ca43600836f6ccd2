"""The choices of the built-in operators' string settings, in one torch-free place.

The declarations (`rlgraph.ops.stages`, read by the compiler) offer these as a param's
``choices``; the bodies and the RL math (`rlgraph.ops.algos`, the reward worker) accept exactly
these. Compiling a pipeline imports this module, never torch.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = ["AGG_MODES", "LOSS_MODES", "KL_KINDS", "ESTIMATORS", "ESTIMATOR_NEEDS", "ON_ERROR", "EXECUTORS", "ENGINE_BACKENDS",
           "parse_token_ids"]

# how token losses are aggregated (BRIEF section 3)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOSS_MODES = ("vanilla", "gspo")  # actor.loss_mode: PPO clip per token, or GSPO per sequence

# per-token KL estimators: k1 (kl), abs, k2 (mse), k3 (low_var_kl)
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

# advantage estimator -> (the granularity its statistics need, whether it reads critic values)
ESTIMATOR_NEEDS: Mapping[str, tuple[str, bool]] = MappingProxyType({
    "gae": ("batch", True),
    "grpo": ("group", False),
    "drgrpo": ("group", False),
    "rloo": ("group", False),
    "reinforce_plus_plus": ("batch", False),
    "reinforce_plus_plus_baseline": ("batch", False),
    "distill": ("group", False),  # on-policy distillation: per-token reverse KL to a teacher (+ GRPO's, weighted)
})
ESTIMATORS = tuple(ESTIMATOR_NEEDS)

# what the rule-reward op does with a sample whose function raised or timed out
ON_ERROR = ("fail", "zero", "drop_group")

# how a reward worker scores a call's samples concurrently
EXECUTORS = ("thread", "process")

# training engines behind update_actor / update_critic
ENGINE_BACKENDS = ("torch", "deepspeed", "fsdp2")


def parse_token_ids(text: str) -> tuple[int, ...]:
    """``"7, 9"`` -> ``(7, 9)``: the rollout.stop_token_ids param (checked when compiling, read by
    the generate op)."""
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"rollout.stop_token_ids={text!r} must be token ids separated by commas, e.g. '7,9'") from None
