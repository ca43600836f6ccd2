"""The advantage op: optional KL penalty in the reward, then the configured estimator.

A class, because the adaptive KL controller carries its coefficient from step to step (and into
checkpoints). Runs as a barrier for whitening estimators and per group for GRPO/RLOO.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlgraph.ops.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty, compute_advantage
from rlgraph.ops.algos import masked_mean

__all__ = ["AdvantageWorker"]


class AdvantageWorker:
    def setup(self, ctx: Any) -> None:
        self.kl_ctrl: Any = None
        self.last_step = -1
        self.step_kl: list[float] = []

    def _controller(self, kl_ctrl: str, kl_coef: float, kl_target: float, kl_horizon: int) -> Any:
        if self.kl_ctrl is None:
            self.kl_ctrl = (AdaptiveKLController(kl_coef, kl_target, kl_horizon) if kl_ctrl == "adaptive"
                            else FixedKLController(kl_coef))
            if getattr(self, "_pending_ctrl", None):  # restored from a checkpoint
                self.kl_ctrl.load_state_dict(self._pending_ctrl)
                self._pending_ctrl = None
        return self.kl_ctrl

    def compute_advantage(self, token_level_scores: torch.Tensor, response_mask: torch.Tensor,
                          uid: torch.Tensor, is_padding: torch.Tensor, values: torch.Tensor | None = None,
                          old_log_probs: torch.Tensor | None = None, ref_log_prob: torch.Tensor | None = None,
                          teacher_log_probs: torch.Tensor | None = None, *,
                          estimator: str, gamma: float, lam: float, norm_adv_by_std: bool, use_kl_in_reward: bool,
                          kl_penalty: str, kl_coef: float, kl_ctrl: str, kl_target: float, kl_horizon: int,
                          distill_task_weight: float = 0.0, distill_kl_weight: float = 1.0,
                          ctx: Any) -> dict[str, Any]:
        R = token_level_scores.shape[1]
        mask = response_mask[:, :R].float() * (~is_padding.bool()).unsqueeze(1).float()
        metrics: dict[str, float] = {}
        rewards = token_level_scores
        if use_kl_in_reward:
            ctrl = self._controller(kl_ctrl, kl_coef, kl_target, kl_horizon)
            if ctx.step != self.last_step and self.step_kl:  # once per step: adapt to last step's KL
                kls = [k for k, _ in self.step_kl]
                ctrl.update(sum(kls) / len(kls), n_steps=sum(n for _, n in self.step_kl))
                self.step_kl = []
            rewards, current_kl = apply_kl_penalty(token_level_scores, old_log_probs[:, :R], ref_log_prob[:, :R],
                                                   mask, ctrl.value, kl_penalty)
            self.step_kl.append((float(current_kl), int((~is_padding.bool()).sum())))
            metrics.update({"kl": float(current_kl), "kl_coef": float(ctrl.value)})
        self.last_step = ctx.step
        distill = {}
        if estimator == "distill":
            distill = dict(student_log_probs=old_log_probs[:, :R], teacher_log_probs=teacher_log_probs[:, :R],
                           distill_task_weight=distill_task_weight, distill_kl_weight=distill_kl_weight)
            reverse_kl = (old_log_probs[:, :R].float() - teacher_log_probs[:, :R].float()) * mask
            metrics["reverse_kl/mean"] = float(masked_mean(reverse_kl, mask))  # per token, on the student's samples
        res = compute_advantage(estimator, rewards, mask, uid.long(),
                                values=values[:, :R] if values is not None else None,
                                gamma=gamma, lam=lam, norm_adv_by_std=norm_adv_by_std, **distill)
        metrics["advantages/mean"] = float(masked_mean(res.advantages, mask))
        metrics["returns/mean"] = float(masked_mean(res.returns, mask))
        return {"advantages": res.advantages * mask, "returns": res.returns * mask,
                "token_level_rewards": rewards * mask, "advantage_metrics": metrics}

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "step_kl": [list(x) for x in self.step_kl], "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step_kl = [tuple(x) for x in state.get("step_kl", [])]
        self.last_step = int(state.get("last_step", -1))
        self._pending_ctrl = state.get("kl_ctrl")
