"""The DeepSpeed backend: ZeRO stage 0-3 through `deepspeed.initialize`, torch AdamW as client optimizer.

Gradient accumulation: we tell DeepSpeed where a mini-batch ends with
`set_gradient_accumulation_boundary` before each micro-batch and call `step()` once per
mini-batch, so DeepSpeed's own `gradient_accumulation_steps` stays 1 (its batch-size entries
are bookkeeping only) and a mini-batch may hold any number of micro-batches. The LR schedule is
ours, on the client optimizer, stepped once per training step; DeepSpeed gets no scheduler.

The client optimizer is the torch AdamW, so nothing is compiled for the optimizer (DeepSpeed's
CPU Adam is a JIT-built extension); see `_skip_shm_comm_build` for the one other build.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from rlgraph.ops.train.engine.base import (STATE_FORMAT, TrainEngine, check_state, iter_params_with_grad,
                                           load_plain_optimizer_state, plain_optimizer_state, trainable_parameters)
from rlgraph.ops.train.engine.config import EngineConfig, EngineError
from rlgraph.ops.train.engine.dist import init_distributed

__all__ = ["DeepSpeedEngine", "deepspeed_config"]


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:
        raise EngineError("backend='deepspeed' needs the deepspeed package: install it with "
                          "`pip install 'rlgraph[deepspeed]'` (deepspeed==0.19.8)") from e
    return deepspeed


def _skip_shm_comm_build(deepspeed: Any) -> None:
    """On the CPU accelerator, deepspeed.comm JIT-compiles a shared-memory all-reduce kernel when it
    starts (`deepspeed_shm_comm`: 40-140 s of C++ compiling on first use, cached under
    TORCH_EXTENSIONS_DIR). Only `inference_all_reduce` uses it; training collectives go through
    torch.distributed (gloo). Marking the op incompatible skips the build."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(config: EngineConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict the engine passes to `deepspeed.initialize`."""
    generated = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: `train` sets the accumulation boundary
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "steps_per_print": 2**31 - 1,  # no progress lines in worker logs
    }
    return _merge(generated, config.deepspeed_config)


class DeepSpeedEngine(TrainEngine):
    """Under ZeRO >= 1 each rank holds a shard of the optimizer state (and from stage 3 of the weights)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, rank: int, world_size: int) -> None:
        deepspeed = _import_deepspeed()
        self.config, self.rank, self.world_size = config, rank, world_size
        if not dist.is_initialized():  # create() checked that world_size == 1 here
            init_distributed(rank, world_size, always=True)
        # deepspeed.comm reads these even when torch.distributed is up (else it tries MPI discovery)
        for key, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", 0),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29500)):
            os.environ.setdefault(key, str(value))
        _skip_shm_comm_build(deepspeed)
        self.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=config.lr, betas=config.betas,
                                           eps=config.eps, weight_decay=config.weight_decay)
        self.ds_config = deepspeed_config(config, world_size)
        self._engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config,
                                                     dist_init_required=False)
        self.module = self._engine.module
        self.zero_stage = int(self.ds_config["zero_optimization"].get("stage", 0))
        # ZeRO wraps the AdamW but keeps stepping it (on flat fp32 partitions), so its LR is the one to schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.schedule())
        self.optimizer_steps = 0

    @property
    def sharded_state(self) -> bool:
        """True when state_dict() differs per rank (ZeRO >= 1): every rank's must be saved."""
        return self.zero_stage >= 1

    @property
    def model(self) -> Any:
        return self._engine

    @property
    def device(self) -> torch.device:
        return torch.device(self._engine.device)

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        # set before the forward/backward: at the boundary DeepSpeed reduces the gradients over ranks
        self._engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def _backward(self, loss: Tensor) -> None:
        self._engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        grad_norm = None
        if self.zero_stage == 0:  # DeepSpeed keeps no norm here; gradients are whole and reduced by now
            params = list(iter_params_with_grad(self.module))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf)) if params else 0.0
        self._engine.step()
        if grad_norm is None:
            norm = self._engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else math.nan
        if self._engine.was_step_applied():
            self.optimizer_steps += 1
        return grad_norm

    def _gathered(self, modifier_rank: int | None) -> contextlib.AbstractContextManager:
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank)

    @contextlib.contextmanager
    def _optimizer_params(self):
        """ZeRO-3 leaves the AdamW's param groups empty between steps (its state is keyed by the flat
        fp32 partitions); put them back while we read or write that state, as DeepSpeed's own
        checkpointing does."""
        zero = self._engine.optimizer
        if self.zero_stage < 3:
            yield
            return
        zero._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            zero._clear_fp32_optimizer_param_groups()

    def weights(self) -> dict[str, Tensor]:
        """Full weights on every rank. Under ZeRO-3 a gathered copy; else the live tensors (no copy)."""
        with self._gathered(modifier_rank=None):
            sd = self.module.state_dict()
            return {k: v.detach().clone() for k, v in sd.items()} if self.zero_stage == 3 else sd

    def _expect(self) -> dict[str, Any]:
        expect: dict[str, Any] = {"backend": "deepspeed", "zero_stage": self.zero_stage}
        if self.sharded_state:
            expect.update(world_size=self.world_size, rank=self.rank)
        return expect

    def state_dict(self) -> dict[str, Any]:
        """Full model weights, this rank's optimizer shard, the scheduler (plain values only)."""
        with self._optimizer_params():
            optimizer = plain_optimizer_state(self.optimizer)
        return {"format": STATE_FORMAT, "backend": "deepspeed", "zero_stage": self.zero_stage,
                "world_size": self.world_size, "rank": self.rank, "model": self.weights(), "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, self._expect())
        with self._gathered(modifier_rank=0):  # rank 0's copy is re-partitioned on exit; all ranks load the same
            self.module.load_state_dict(state["model"])
        if self.zero_stage >= 1:  # the fp32 master shard the optimizer steps is a copy: refresh it from the model
            self._engine.optimizer.refresh_fp32_params()
        with self._optimizer_params():
            load_plain_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(dict(state["scheduler"]))
        self.optimizer_steps = int(state["optimizer_steps"])
