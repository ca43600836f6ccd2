"""Advantage estimators: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline.

Inputs are `[b, T]` over response tokens, right-padded; `response_mask` is 1 on valid tokens.
`uid` (`[b]`, int64) names each sample's prompt: samples with the same uid form a group.
A padding row (all-zero mask, a uid of its own) changes no real sample's advantage: group
statistics are per uid and whitening statistics count masked tokens only.

Outcome-reward estimators take the score of a sample as the sum of its token rewards over
valid tokens (verl sums the whole row; the two agree when padding rewards are 0, and masking
here keeps garbage in padding positions out of the score).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlgraph.errors import ConfigError
from rlgraph.ops.algos.core import masked_whiten
from rlgraph.ops.names import ESTIMATORS

__all__ = [
    "ESTIMATORS",
    "AdvantageResult",
    "compute_advantage",
    "gae_advantages",
    "grpo_advantages",
    "distill_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
]



class AdvantageResult(NamedTuple):
    advantages: Tensor  # [b, T], 0 on padding
    returns: Tensor  # [b, T], 0 on padding; the value target for GAE


class _Groups(NamedTuple):
    size: Tensor  # [b] number of samples sharing this sample's uid
    mean: Tensor  # [b] mean score of this sample's group
    std: Tensor  # [b] unbiased std of the group's scores (0 for a group of one)


def _check(fn: str, rewards: Tensor, mask: Tensor, uid: Tensor | None = None, values: Tensor | None = None) -> None:
    """Collect every shape/dtype problem, then raise once with all of them."""
    problems = []
    if rewards.dim() != 2:
        problems.append(f"token_level_rewards must be [b, T], got shape {tuple(rewards.shape)}")
    if mask.shape != rewards.shape:
        problems.append(
            f"response_mask has shape {tuple(mask.shape)} but token_level_rewards has "
            f"{tuple(rewards.shape)}; they must match"
        )
    if values is not None and values.shape != rewards.shape:
        problems.append(
            f"values has shape {tuple(values.shape)} but token_level_rewards has "
            f"{tuple(rewards.shape)}; they must match"
        )
    if uid is not None:
        if uid.shape != rewards.shape[:1]:
            problems.append(f"uid has shape {tuple(uid.shape)}; it must be [b] = {tuple(rewards.shape[:1])}")
        if uid.dtype.is_floating_point or uid.dtype == torch.bool:
            problems.append(f"uid has dtype {uid.dtype}; pass an integer (int64) prompt id per sample")
    if problems:
        raise ValueError(f"{fn}: " + "; ".join(problems))


def _scores(rewards: Tensor, mask: Tensor) -> Tensor:
    # s_i = sum_t r_{i,t} * m_{i,t}
    return (rewards * mask).sum(dim=-1)  # [b]


def _group_stats(scores: Tensor, uid: Tensor) -> _Groups:
    """Size, mean and unbiased std of each sample's group, gathered back to `[b]`."""
    if scores.numel() == 0:
        return _Groups(size=scores, mean=scores, std=scores)
    _, group = torch.unique(uid, return_inverse=True)  # [b] group index of each sample
    n_groups = int(group.max().item()) + 1
    zeros = scores.new_zeros(n_groups)
    size = zeros.index_add(0, group, torch.ones_like(scores))  # [G]
    mean = zeros.index_add(0, group, scores) / size  # [G]
    sq_dev = zeros.index_add(0, group, (scores - mean[group]) ** 2)  # [G]
    # std = sqrt(sum (s - mean)^2 / (n - 1)); defined for n > 1 only
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    return _Groups(size=size[group], mean=mean[group], std=std[group])


def _baseline(groups: _Groups) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and std under the one rule for groups of one (verl's, for every
    group estimator): a group of one has baseline 0 and std 1, so its advantage is its raw score."""
    single = groups.size == 1
    return (torch.where(single, torch.zeros_like(groups.mean), groups.mean),
            torch.where(single, torch.ones_like(groups.std), groups.std))


def gae_advantages(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> AdvantageResult:
    """Generalised Advantage Estimation (Schulman et al. 2016), whitened over the batch.

    Runs backwards over valid tokens only: a masked position passes the next valid token's
    V and A through unchanged, so V beyond the last valid token is 0 and padding adds nothing.
    """
    _check("gae_advantages", token_level_rewards, response_mask, values=values)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])  # V_{t+1}
    next_adv = torch.zeros_like(values[:, 0])  # A_{t+1}
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        # delta_t = r_t + gamma * V_{t+1} - V_t
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        # A_t = delta_t + gamma * lam * A_{t+1}
        adv = delta + gamma * lam * next_adv
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        next_adv = mask[:, t] * adv + (1 - mask[:, t]) * next_adv
        advantages[:, t] = next_adv
    # R_t = A_t + V_t  (before whitening: the critic's target)
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, mask) * mask
    return AdvantageResult(advantages=advantages, returns=returns)


def grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    uid: Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """GRPO (Shao et al. 2024): each score normalised within its prompt's group.

    With `norm_adv_by_std=False` this is Dr.GRPO (Liu et al. 2025): mean-centred only.
    A group of one gets mean 0 and std 1, i.e. its advantage is its raw score (as in verl).
    """
    _check("grpo_advantages", token_level_rewards, response_mask, uid=uid)
    mask = response_mask.to(token_level_rewards.dtype)
    scores = _scores(token_level_rewards, mask)
    mean, std = _baseline(_group_stats(scores, uid))
    if norm_adv_by_std:
        # A_i = (s_i - mean_g) / (std_g + eps)
        adv = (scores - mean) / (std + eps)
    else:
        # A_i = s_i - mean_g
        adv = scores - mean
    advantages = adv.unsqueeze(-1) * mask
    return AdvantageResult(advantages=advantages, returns=advantages)


def rloo_advantages(token_level_rewards: Tensor, response_mask: Tensor, uid: Tensor) -> AdvantageResult:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): baseline = mean score of the others.

    A group of one has no "others": baseline 0, so its advantage is its raw score (verl's rule,
    the same for every group estimator here; see `_baseline`).
    """
    _check("rloo_advantages", token_level_rewards, response_mask, uid=uid)
    mask = response_mask.to(token_level_rewards.dtype)
    scores = _scores(token_level_rewards, mask)
    groups = _group_stats(scores, uid)
    n = groups.size
    # A_i = s_i - mean_{j != i} s_j = s_i * n/(n-1) - mean_g * n/(n-1)
    scale = n / (n - 1).clamp(min=1)
    mean, _ = _baseline(groups)
    adv = torch.where(n > 1, scores * scale - mean * scale, scores - mean)  # n = 1: s - 0
    advantages = adv.unsqueeze(-1) * mask
    return AdvantageResult(advantages=advantages, returns=advantages)


def reinforce_pp_advantages(token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): discounted return-to-go of token rewards, whitened over the batch.

    `returns` is the un-whitened return-to-go.
    """
    _check("reinforce_pp_advantages", token_level_rewards, response_mask)
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = token_level_rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # G_{t+1}
    for t in reversed(range(rewards.shape[1])):
        # G_t = r_t + gamma * G_{t+1}
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = returns * mask
    advantages = masked_whiten(returns, mask) * mask
    return AdvantageResult(advantages=advantages, returns=returns)


def reinforce_pp_baseline_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, uid: Tensor
) -> AdvantageResult:
    """REINFORCE++-baseline, read as verl implements it.

    score s_i = sum of token rewards; subtract the group's mean score (a group of one has
    mean 0, as in GRPO); broadcast the scalar over the valid tokens; whiten over all valid
    tokens of the batch. There is no discounting: the baseline is per sample, not per token.
    Whitening is per token, so a long response weighs more in the batch mean/std than a short one.
    """
    _check("reinforce_pp_baseline_advantages", token_level_rewards, response_mask, uid=uid)
    mask = response_mask.to(token_level_rewards.dtype)
    scores = _scores(token_level_rewards, mask)
    mean, _ = _baseline(_group_stats(scores, uid))
    # A_{i,t} = whiten(s_i - mean_g)
    centred = (scores - mean).unsqueeze(-1) * mask
    advantages = masked_whiten(centred, mask) * mask
    return AdvantageResult(advantages=advantages, returns=advantages)


def distill_advantages(student_log_probs: Tensor, teacher_log_probs: Tensor, response_mask: Tensor,
                       token_level_rewards: Tensor | None = None, uid: Tensor | None = None, task_weight: float = 0.0,
                       norm_adv_by_std: bool = True, kl_weight: float = 1.0) -> AdvantageResult:
    """On-policy distillation: the student samples, the teacher scores each sampled token, and the
    token's advantage is minus the per-token reverse KL (the single-sample estimate on the student's
    own token, with no discounting between tokens):

        A_t = -(log p_student(x_t) - log p_teacher(x_t)) = log p_teacher(x_t) - log p_student(x_t)

    (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD) with the reverse KL;
    Thinking Machines Lab 2025, "On-Policy Distillation", which trains on exactly this advantage with
    the importance-sampled policy-gradient loss). `student_log_probs` are the sampling policy's
    (old_log_probs). With `task_weight` > 0, GRPO's group-normalised task advantage (from
    `token_level_rewards` and `uid`) is added, times the weight. `kl_weight` scales the reverse-KL
    term (0: the teacher's signal comes from the update's dense loss instead, `algos.distill`).
    Returns equal the advantages."""
    mask = response_mask.to(student_log_probs.dtype)
    adv = kl_weight * (teacher_log_probs.float() - student_log_probs.float()) * mask
    if task_weight:
        if token_level_rewards is None or uid is None:
            raise ValueError("distill_advantages with task_weight > 0 needs token_level_rewards and uid")
        adv = adv + task_weight * grpo_advantages(token_level_rewards, response_mask, uid,
                                                  norm_adv_by_std=norm_adv_by_std).advantages
    adv = adv * mask
    return AdvantageResult(adv, adv)


def compute_advantage(
    estimator: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    uid: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    student_log_probs: Tensor | None = None,
    teacher_log_probs: Tensor | None = None,
    distill_task_weight: float = 0.0,
    distill_kl_weight: float = 1.0,
) -> AdvantageResult:
    """Dispatch on the estimator name (`algorithm.adv_estimator` in the config).

    Each estimator reads only what it needs: "gae" needs `values`, gamma and lam;
    "reinforce_plus_plus" gamma; the group estimators `uid`. "drgrpo" is "grpo" with
    `norm_adv_by_std=False` whatever is passed; `norm_adv_by_std` only affects "grpo".
    """
    with torch.no_grad():
        if estimator == "gae":
            if values is None:
                raise ValueError("compute_advantage: estimator 'gae' needs values=[b, T] from the critic")
            return gae_advantages(token_level_rewards, values, response_mask, gamma=gamma, lam=lam)
        if estimator == "grpo":
            return grpo_advantages(token_level_rewards, response_mask, uid, norm_adv_by_std=norm_adv_by_std)
        if estimator == "drgrpo":
            return grpo_advantages(token_level_rewards, response_mask, uid, norm_adv_by_std=False)
        if estimator == "rloo":
            return rloo_advantages(token_level_rewards, response_mask, uid)
        if estimator == "reinforce_plus_plus":
            return reinforce_pp_advantages(token_level_rewards, response_mask, gamma=gamma)
        if estimator == "reinforce_plus_plus_baseline":
            return reinforce_pp_baseline_advantages(token_level_rewards, response_mask, uid)
        if estimator == "distill":
            if student_log_probs is None or teacher_log_probs is None:
                raise ValueError("compute_advantage: estimator 'distill' needs student_log_probs (old_log_probs) "
                                 "and teacher_log_probs (stages.teacher_logprob)")
            return distill_advantages(student_log_probs, teacher_log_probs, response_mask, token_level_rewards, uid,
                                      distill_task_weight, norm_adv_by_std, distill_kl_weight)
    raise ConfigError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
