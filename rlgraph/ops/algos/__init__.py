"""The RL math of PPO/GRPO post-training, in pure torch: masked statistics, advantage
estimators, KL penalties and controllers, and the PPO losses (BRIEF section 3).

No Ray, no models: every function takes `[b, T]` tensors over response tokens and is tested
against values worked out by hand. `advantage_op` holds the advantage op's body
(`AdvantageWorker`: KL in the reward, then the estimator); it is not imported here.
"""

from rlgraph.ops.algos.advantages import (
    ESTIMATORS,
    AdvantageResult,
    compute_advantage,
    distill_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlgraph.ops.algos.core import (
    AGG_MODES,
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)
from rlgraph.ops.algos.distill import drop_unusable, generalized_jsd, top_k_distill_loss, usable_ids, with_tail
from rlgraph.ops.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLPenaltyResult,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
)
from rlgraph.ops.algos.losses import (
    LOSS_MODES,
    PolicyLossResult,
    ValueLossResult,
    gspo_policy_loss,
    policy_loss,
    value_loss,
)
from rlgraph.ops.algos.rollout_correction import ProbsDiff, decoupled_weights, rollout_probs_diff, truncated_is_weights

__all__ = [
    "LOSS_MODES",
    "gspo_policy_loss",
    "AGG_MODES",
    "ESTIMATORS",
    "KL_KINDS",
    "AdaptiveKLController",
    "AdvantageResult",
    "distill_advantages",
    "generalized_jsd",
    "top_k_distill_loss",
    "usable_ids",
    "drop_unusable",
    "with_tail",
    "FixedKLController",
    "KLPenaltyResult",
    "PolicyLossResult",
    "ProbsDiff",
    "ValueLossResult",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "value_loss",
    "reinforce_pp_advantages",
    "rollout_probs_diff",
    "truncated_is_weights",
    "decoupled_weights",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]
