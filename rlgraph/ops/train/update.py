"""Glue between the update ops and the training engine, shared by the actor and the critic.

The engine (`rlgraph.ops.train.engine`) is created on the first update call, with the params of that
op (lr, backend, ZeRO stage, ...). Ranks of a group join one process group at setup (the
runtime gives each group rank 0's address and a free port), so DDP and DeepSpeed reduce
gradients across the group's Ray actors.

Sizes come from the plan (``ctx.batching``): the runtime hands each rank its share of the padded
batch; a rank's share of one mini-batch is ``rank_mini_batch[0]`` samples (``mini_batch_size * n
/ dp``, rounded down), its micro-batch ``micro_batch_size`` samples, and every rank runs the same
number of mini-batches, ``epochs`` times.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from rlgraph.graph.settings import TrainerSettings

__all__ = ["kept_rows", "TrainerMixin"]


def kept_rows(ctx: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[rows, 1]: 0 for rows tagged as padding in this call (rows added to fill the batch, and
    samples dropped earlier in the step, e.g. by a failed reward), else 1. Multiply loss masks by it."""
    return torch.tensor([[0 if p else 1] for p in ctx.is_padding], dtype=dtype)


class TrainerMixin:
    """Adds ``self.train(...)`` to a worker class; call ``init_trainer(ctx)`` in ``setup``."""

    engine: Any = None

    def init_trainer(self, ctx: Any, settings: Any = None) -> None:
        """`settings`: the update's section (ActorSettings/CriticSettings), for the engine's setup keys."""
        self.rank, self.dp = ctx.rank, ctx.dp
        self.engine_options = ({"mixed_precision": settings.mixed_precision, "cpu_offload": settings.cpu_offload}
                               if settings is not None else {})
        self.seed = TrainerSettings.of(ctx).seed
        self.engine = None
        self._pending_state: Mapping[str, Any] | None = None
        if ctx.dp > 1:
            from rlgraph.ops.train.engine import init_distributed

            # NCCL between GPUs, gloo between CPU processes
            init_distributed(ctx.rank, ctx.dp, master_addr=ctx.master_addr, master_port=ctx.master_port,
                             backend="nccl" if torch.cuda.is_available() else "gloo")

    def train(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], loss_fn: Callable, ctx: Any, *,
              lr: float, weight_decay: float, grad_clip: float, lr_warmup_steps: int, backend: str,
              zero_stage: int, max_tokens_per_micro_batch: int = 0) -> dict[str, Any]:
        """One update call: mini-batches x epochs over this rank's rows (sizes from ``ctx.batching``);
        returns metrics averaged over the optimizer steps. The engine params apply on the first call.
        With `max_tokens_per_micro_batch`, micro-batches are formed by that token budget over the
        batch's ``seq_tokens`` column (each row's forward tokens) instead of ``micro_batch_size`` rows."""
        from rlgraph.ops.train.engine import EngineConfig, create_engine

        if self.engine is None:
            cfg = EngineConfig(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, lr_warmup_steps=lr_warmup_steps,
                               backend=backend, zero_stage=zero_stage, seed=self.seed,
                               **(self.engine_options if backend == "fsdp2" else {}))
            self.engine = create_engine(model, cfg, rank=self.rank, world_size=self.dp)
            if self._pending_state is not None:
                self.engine.load_state_dict(self._pending_state)
                self._pending_state = None
        b = ctx.batching
        rows = int(batch["response_mask"].shape[0])
        per_rank = max(1, b.rank_mini_batch[0])
        model.train()
        history = self.engine.train(batch, loss_fn, mini_batch_size=min(per_rank, rows),
                                    micro_batch_size=b.micro_batch_size, epochs=b.epochs,
                                    seed=self.seed + 1000 * ctx.step,
                                    max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                    length_key="seq_tokens" if max_tokens_per_micro_batch else "")
        return _summarise(history)
    def trainer_state(self) -> Mapping[str, Any] | None:
        return self.engine.state_dict() if self.engine is not None else self._pending_state

    def load_trainer_state(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            return
        if self.engine is not None:
            self.engine.load_state_dict(state)
        else:  # the engine is made on the first update: restore into it then
            self._pending_state = state


def _summarise(history: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean of each numeric metric over the optimizer steps, plus the number of steps."""
    out: dict[str, Any] = {"optimizer_steps": len(history)}
    keys = sorted({k for h in history for k, v in h.items() if isinstance(v, (int, float))})
    for k in keys:
        vals = [float(h[k]) for h in history if isinstance(h.get(k), (int, float))]
        out[k] = sum(vals) / len(vals)
    return out
