"""`EngineConfig`, the engine's error type and the learning-rate schedule.

The schedule counts *training steps* (calls of `TrainEngine.train`), not optimizer steps:
BRIEF section 2 says "step the LR scheduler once per update call", as verl does, so the LR of
a step does not depend on how many mini-batches or epochs the update had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from rlgraph.errors import ConfigError, RLGraphError

__all__ = ["EngineConfig", "EngineError", "lr_factor"]


class EngineError(RLGraphError, ValueError):
    """A training engine was used wrongly: sizes that do not split, ranks that disagree, a bad state."""


@dataclass(frozen=True)
class EngineConfig:
    """How a `TrainEngine` optimises its model. Checked when built: every problem is reported at once."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, applied to every parameter."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks) to this value; 0 turns clipping off."""
    lr_warmup_steps: int = 0
    """Linear warm-up over this many training steps (train calls): step k uses lr*(k+1)/warmup."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it along a half cosine to lr*min_lr_ratio at total_steps."""
    total_steps: int = 0
    """Training steps of the run; needed (> lr_warmup_steps) by the cosine schedule only."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    backend: Literal["torch", "deepspeed", "fsdp2"] = "torch"
    """'torch': AdamW, DDP over the process group when dp > 1. 'deepspeed': ZeRO via deepspeed.initialize.
    'fsdp2': torch's fully_shard (parameters, gradients and optimizer state sharded over the ranks)."""
    zero_stage: int = 0
    """ZeRO stage 0-3 (deepspeed backend only)."""
    seed: int = 0
    """Default shuffle seed of `train` when the caller passes none (see `TrainEngine.train`)."""
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    """fsdp2: compute in bfloat16 with float32 masters and float32 gradient reduction ('bf16'), in float32
    ('fp32'), or bf16 on a CUDA device that supports it and fp32 elsewhere ('auto')."""
    cpu_offload: bool = False
    """fsdp2: keep parameter shards, gradients and optimizer state in CPU memory between uses."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config entries, merged over the generated ones (nested dicts merge key by key)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.lr > 0:
            problems.append(f"lr must be > 0, got {self.lr!r}")
        if self.weight_decay < 0:
            problems.append(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip < 0:
            problems.append(f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip!r}")
        if self.lr_warmup_steps < 0:
            problems.append(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        elif self.lr_schedule == "cosine" and self.total_steps <= self.lr_warmup_steps:
            problems.append(f"lr_schedule='cosine' needs total_steps > lr_warmup_steps, got total_steps="
                            f"{self.total_steps} and lr_warmup_steps={self.lr_warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.backend not in ("torch", "deepspeed", "fsdp2"):
            problems.append(f"backend must be 'torch', 'deepspeed' or 'fsdp2', got {self.backend!r}")
        if self.mixed_precision not in ("auto", "fp32", "bf16"):
            problems.append(f"mixed_precision must be 'auto', 'fp32' or 'bf16', got {self.mixed_precision!r}")
        elif self.mixed_precision == "bf16" and self.backend != "fsdp2":
            problems.append("mixed_precision='bf16' needs backend='fsdp2' (DeepSpeed takes bf16 from deepspeed_config)")
        if self.cpu_offload and self.backend != "fsdp2":
            problems.append("cpu_offload needs backend='fsdp2' (under DeepSpeed use ZeRO's offload_param in "
                            "deepspeed_config)")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        elif self.zero_stage and self.backend != "deepspeed":
            problems.append(f"zero_stage={self.zero_stage} needs backend='deepspeed' (the torch backend is plain DDP)")
        if self.deepspeed_config and self.backend != "deepspeed":
            problems.append("deepspeed_config is set but backend is not 'deepspeed'")
        if problems:
            raise ConfigError("EngineConfig has {} problem{}:\n{}".format(
                len(problems), "s" if len(problems) > 1 else "", "\n".join(f"  - {p}" for p in problems)))

    def schedule(self) -> Callable[[int], float]:
        """The LR multiplier as a function of the training step (for `torch.optim.lr_scheduler.LambdaLR`)."""
        def factor(step: int) -> float:
            return lr_factor(step, self.lr_warmup_steps, self.lr_schedule, self.total_steps, self.min_lr_ratio)
        return factor


def lr_factor(step: int, warmup: int, schedule: str = "constant", total_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """LR multiplier for training step `step` (0 for the first train call).

    Warm-up starts at 1/warmup, not 0 (verl's starts at 0, which wastes the first step):
        factor = (step + 1) / warmup                                   while step < warmup
    then 1 (constant), or for cosine, with p = (step - warmup) / (total_steps - warmup) capped at 1:
        factor = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
