"""The torch backend: AdamW, and DDP over the process group when dp > 1."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from rlgraph.ops.train.engine.base import (STATE_FORMAT, TrainEngine, check_state, iter_params_with_grad,
                                           load_model_state, load_plain_optimizer_state, model_state,
                                           plain_optimizer_state, trainable_parameters)
from rlgraph.ops.train.engine.config import EngineConfig

__all__ = ["TorchEngine"]


class TorchEngine(TrainEngine):
    """Every rank holds the whole model and optimizer state; DDP averages the gradients over ranks."""

    sharded_state = False  # state_dict() is the same on every rank: saving rank 0's is enough

    def __init__(self, model: torch.nn.Module, config: EngineConfig, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.module = model
        self._device = next(model.parameters()).device
        # DDP broadcasts rank 0's weights at construction, so ranks start equal whatever their init
        self._wrapped: Any = model if world_size == 1 else DistributedDataParallel(
            model, device_ids=[self._device] if self._device.type == "cuda" else None)
        self._optimizer_for(model)

    def _optimizer_for(self, module: torch.nn.Module) -> None:
        """AdamW over `module`'s trainable parameters, its LR schedule and the step counters."""
        self.optimizer = torch.optim.AdamW(trainable_parameters(module), lr=self.config.lr, betas=self.config.betas,
                                           eps=self.config.eps, weight_decay=self.config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.schedule())
        self.optimizer_steps = 0
        self.skipped_steps = 0

    @property
    def model(self) -> Any:
        return self._wrapped

    @property
    def device(self) -> torch.device:
        return self._device

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP reads the flag in forward, so no_sync must cover forward and backward of the micro-batch
        if last or self.world_size == 1:
            return contextlib.nullcontext()
        return self._wrapped.no_sync()

    def _backward(self, loss: Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> float:
        params = list(iter_params_with_grad(self.module))
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else None
        # a DTensor under FSDP2 (the global norm, the same on every rank)
        grad_norm = 0.0 if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.optimizer_steps += 1
        else:  # a NaN/inf gradient would poison the weights and Adam moments for good: drop it
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def weights(self) -> dict[str, Tensor]:
        """The live model tensors, detached (no copy): copy them before training again if you keep them."""
        return self.module.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "backend": "torch", "model": model_state(self.module),
                "optimizer": plain_optimizer_state(self.optimizer), "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, {"backend": "torch"})
        load_model_state(self.module, state["model"])
        load_plain_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(dict(state["scheduler"]))
        self.optimizer_steps = int(state["optimizer_steps"])
