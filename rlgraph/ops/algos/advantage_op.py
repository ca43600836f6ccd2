"""The advantage op: optional KL penalty in the reward, then the configured estimator.

A class, because the adaptive KL controller carries its coefficient from step to step (and into
checkpoints). Runs as a barrier for whitening estimators and per group for GRPO/RLOO; vectorised:
one body call holds every ready group, and its metrics come back one record per group.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import torch

from rlgraph.ops.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty, compute_advantage
from rlgraph.ops.settings import AlgorithmSettings

__all__ = ["AdvantageWorker"]


class AdvantageWorker:
    def setup(self, ctx: Any) -> None:
        self.kl_ctrl: Any = None
        self.last_step = -1
        self.step_kl: list[float] = []
        self.kl_in_reward = bool(AlgorithmSettings.value(ctx, "use_kl_in_reward"))

    def keeps_state(self) -> bool:
        """Only the KL controller (``algorithm.use_kl_in_reward``) carries anything from step to step;
        without it a worker that died loses nothing, and its calls simply run again."""
        return self.kl_in_reward

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
        sizes = tuple(ctx.chunks) or (token_level_scores.shape[0],)  # vectorised: one call for every ready group
        bounds = _bounds(sizes)
        metrics: list[dict[str, float]] = [{} for _ in sizes]  # one record per chunk, as per-chunk calls give
        rewards = token_level_scores
        if use_kl_in_reward:
            ctrl = self._controller(kl_ctrl, kl_coef, kl_target, kl_horizon)
            if ctx.step != self.last_step and self.step_kl:  # once per step: adapt to last step's KL
                kls = [k for k, _ in self.step_kl]
                ctrl.update(sum(kls) / len(kls), n_steps=sum(n for _, n in self.step_kl))
                self.step_kl = []
            parts = []
            for (a, b), record in zip(bounds, metrics):  # per chunk: the controller sees each group's KL
                part, current_kl = apply_kl_penalty(token_level_scores[a:b], old_log_probs[a:b, :R],
                                                    ref_log_prob[a:b, :R], mask[a:b], ctrl.value, kl_penalty)
                parts.append(part)
                self.step_kl.append((float(current_kl), int((~is_padding[a:b].bool()).sum())))
                record.update({"kl": float(current_kl), "kl_coef": float(ctrl.value)})
            rewards = torch.cat(parts)
        self.last_step = ctx.step
        distill = {}
        if estimator == "distill":
            distill = dict(student_log_probs=old_log_probs[:, :R], teacher_log_probs=teacher_log_probs[:, :R],
                           distill_task_weight=distill_task_weight, distill_kl_weight=distill_kl_weight)
            reverse_kl = (old_log_probs[:, :R].float() - teacher_log_probs[:, :R].float()) * mask
            _record(metrics, "reverse_kl/mean", _chunk_means(reverse_kl, mask, sizes))  # per token, on the student's samples
        res = compute_advantage(estimator, rewards, mask, uid.long(),
                                values=values[:, :R] if values is not None else None,
                                gamma=gamma, lam=lam, norm_adv_by_std=norm_adv_by_std, **distill)
        _record(metrics, "advantages/mean", _chunk_means(res.advantages, mask, sizes))
        _record(metrics, "returns/mean", _chunk_means(res.returns, mask, sizes))
        return {"advantages": res.advantages * mask, "returns": res.returns * mask,
                "token_level_rewards": rewards * mask,
                # one record per chunk of a vectorised call; one record (not a list) for a call of one chunk
                "advantage_metrics": metrics if len(metrics) > 1 else metrics[0]}

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "step_kl": [list(x) for x in self.step_kl], "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step_kl = [tuple(x) for x in state.get("step_kl", [])]
        self.last_step = int(state.get("last_step", -1))
        self._pending_ctrl = state.get("kl_ctrl")


def _bounds(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each chunk's [start, end) rows in the call."""
    ends = list(itertools.accumulate(sizes))
    return list(zip([0, *ends[:-1]], ends))


def _chunk_means(x: torch.Tensor, mask: torch.Tensor, sizes: tuple[int, ...]) -> list[float]:
    """Each chunk's masked mean of `x` over its valid tokens, in one pass for all chunks."""
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # [b] chunk of each row
    # mean_c = sum_{rows i of c, t} x_it m_it / (sum_{rows i of c, t} m_it + 1e-8)
    num = torch.zeros(len(sizes), dtype=x.dtype).index_add(0, chunk, (x * mask).sum(dim=-1))
    den = torch.zeros(len(sizes), dtype=x.dtype).index_add(0, chunk, mask.to(x.dtype).sum(dim=-1))
    return (num / (den + 1e-8)).tolist()


def _record(metrics: list[dict[str, float]], key: str, values: list[float]) -> None:
    for record, v in zip(metrics, values, strict=True):
        record[key] = v
