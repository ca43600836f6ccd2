"""The FSDP2 backend: `torch.distributed.fsdp.fully_shard`, parameters and optimizer state sharded over dp.

Each rank holds 1/dp of every parameter (a DTensor shard) and of AdamW's moments; a block's full
weights exist only while its forward or backward runs (all-gathered, then freed), and gradients are
reduce-scattered. What is sharded: each block the model names as not to be split (transformers'
``_no_split_modules``: its decoder layers), or each direct child with weights for other models,
then the root (embeddings, final norm, output head).

- Mixed precision (``mixed_precision``): ``bf16`` computes in bfloat16 with the float32 shards as
  masters and gradients reduced in float32; ``auto`` picks it on a CUDA device that supports
  bfloat16 and float32 elsewhere (on CPU bfloat16 is slow and changes the numbers).
- ``cpu_offload``: shards, gradients and optimizer state live in CPU memory between uses (on a GPU;
  on a CPU device they are there already, and the option changes nothing).
- Gradient accumulation: gradients are reduced at the mini-batch's last micro-batch only
  (``set_requires_gradient_sync``), as DDP's ``no_sync``. FSDP2 averages over ranks, like DDP, so
  the engine's ``loss * world_size`` gives the sum, and dp=2 updates exactly as DDP does.

The engine trains its own sharded copy of the model it is given; the given model stays whole and
is what the worker generates and computes log-probs with (those passes run on one rank at a time,
in numbers that differ per rank, so they cannot be collectives). After every `train` the copy's
full weights are gathered (a collective every rank makes at the same point) and loaded into it:
the serving model always holds the trained weights, as a rollout engine does under verl's FSDP.

State: this rank's shards of the weights and of the optimizer moments as plain tensors (sharded:
every rank's is saved), restored onto a group of the same dp size.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from rlgraph.ops.train.engine.base import STATE_FORMAT, check_state
from rlgraph.ops.train.engine.config import EngineConfig, EngineError
from rlgraph.ops.train.engine.dist import init_distributed
from rlgraph.ops.train.engine.torch_backend import TorchEngine

__all__ = ["FSDP2Engine", "shard_units"]


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules sharded one by one before the root: transformers' no-split blocks, or the root's
    direct children that hold parameters."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if blocks:
            return blocks
    return [c for c in model.children() if any(True for _ in c.parameters())]


def _bf16_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


class FSDP2Engine(TorchEngine):
    """Parameters, gradients and optimizer state sharded over the group (ZeRO-3 semantics, torch-native). The
    optimizer step (global-norm clipping, a non-finite gradient skipped) is the torch engine's."""

    sharded_state = True

    def __init__(self, model: torch.nn.Module, config: EngineConfig, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.config, self.rank, self.world_size = config, rank, world_size
        if not dist.is_initialized():  # create_engine checked that world_size == 1 here
            init_distributed(rank, world_size, always=True)
        self.serving = model
        device = next(model.parameters()).device
        self._device = device
        self.module = copy.deepcopy(model)
        with torch.no_grad():  # ranks start from rank 0's weights, as DDP's constructor makes them
            for t in (*self.module.parameters(), *self.module.buffers()):
                if world_size > 1:
                    dist.broadcast(t.data, src=0)
        mp = config.mixed_precision
        if mp == "bf16" and not (_bf16_device(device) or device.type == "cpu"):
            raise EngineError(f"mixed_precision='bf16' on {device}: this device has no bfloat16 support; use 'fp32'")
        use_bf16 = mp == "bf16" or (mp == "auto" and _bf16_device(device))
        self.mixed_precision = "bf16" if use_bf16 else "fp32"
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 \
            else MixedPrecisionPolicy()
        # on a CPU device everything is in CPU memory already (and FSDP2's offload pins memory for a GPU)
        self.offloaded = config.cpu_offload and device.type != "cpu"
        offload = CPUOffloadPolicy() if self.offloaded else OffloadPolicy()
        mesh = init_device_mesh(device.type, (world_size,))
        options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
        for unit in shard_units(self.module):
            fully_shard(unit, **options)
        fully_shard(self.module, **options)
        self._optimizer_for(self.module)

    @property
    def model(self) -> Any:
        return self.module

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        # reduce-scatter the gradients at the mini-batch's last backward only
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def weights(self) -> dict[str, Tensor]:
        """The full weights on every rank (a collective: every rank calls it at the same point)."""
        return {k: _full(v) for k, v in self.module.state_dict().items()}

    def after_train(self) -> None:
        """Give the serving model the trained weights."""
        with torch.no_grad():
            self.serving.load_state_dict(self.weights())

    def _expect(self) -> dict[str, Any]:
        return {"backend": "fsdp2", "world_size": self.world_size, "rank": self.rank}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards of the trainable weights and of the optimizer state, the scheduler."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        model = {n: _local(p) for n, p in self.module.named_parameters() if p.requires_grad}
        opt: dict[str, Any] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state:
                    opt[names[id(p)]] = {k: _local(v) if isinstance(v, Tensor) else v for k, v in state.items()}
        return {"format": STATE_FORMAT, **self._expect(), "model": model, "optimizer": opt,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                "scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(state, self._expect())
        params = dict(self.module.named_parameters())
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in state["model"])
        if missing:
            raise EngineError(f"the FSDP2 state lacks weights {missing[:5]}: it was saved from another model")
        with torch.no_grad():
            for n, saved in state["model"].items():
                _local(params[n]).copy_(saved)
        for n, saved in state["optimizer"].items():
            p = params[n]
            self.optimizer.state[p] = {k: _like(p, v) if isinstance(v, Tensor) and v.dim() > 0 else
                                       (v.clone() if isinstance(v, Tensor) else v) for k, v in saved.items()}
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.scheduler.load_state_dict(dict(state["scheduler"]))
        self.optimizer_steps = int(state["optimizer_steps"])
        self.after_train()


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: Tensor, local: Tensor) -> Tensor:
    """A saved local shard as the kind of tensor `param` is (a DTensor on its mesh and placements)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.to(_local(param).device).clone(), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    return local.to(param.device).clone()
