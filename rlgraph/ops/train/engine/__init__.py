"""The training engine behind update_actor and update_critic: one per data-parallel rank.

An engine holds a model, an AdamW optimizer, an LR schedule and, for dp > 1, the group's process
group; `TrainEngine.train` runs one training step (epochs x mini-batches x micro-batches) with
losses normalised by global token counts, so dp ranks together compute exactly what one rank
would on the whole batch. Backends: plain torch (DDP), DeepSpeed (ZeRO 0-3) and FSDP2 (torch's
fully_shard). Micro-batches are a number of rows or, with a token budget, the fewest parts of a
mini-batch whose tokens fit it (`rlgraph.ops.train.engine.balance`).

    init_distributed(rank, world_size, master_port=port)        # each Ray actor, same port
    engine = create_engine(model, EngineConfig(lr=1e-6), rank, world_size)
    metrics = engine.train(batch, loss_fn, mini_batch_size=8, micro_batch_size=2, epochs=1)
    weights = engine.weights()                                   # to the rollout engine
"""

import torch

from rlgraph.ops.train.engine.base import STATE_FORMAT, LossFn, TrainEngine
from rlgraph.ops.train.engine.config import EngineConfig, EngineError, lr_factor
from rlgraph.ops.train.engine.dist import free_port, init_distributed

__all__ = ["EngineConfig", "EngineError", "LossFn", "STATE_FORMAT", "TrainEngine", "create_engine", "free_port",
           "init_distributed", "lr_factor"]


def create_engine(model: torch.nn.Module, config: EngineConfig, rank: int = 0, world_size: int = 1) -> TrainEngine:
    """Wrap `model` for training as rank `rank` of `world_size`, on the backend `config` names.

    With ``world_size > 1`` call `init_distributed` first. The deepspeed and fsdp2 backends create a
    one-rank process group themselves when there is none.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise EngineError(f"create_engine needs 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise EngineError(f"rank {rank} of {world_size}: no process group; call "
                              f"init_distributed(rank, world_size, master_port=...) before create_engine")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise EngineError(f"create_engine(rank={rank}, world_size={world_size}) disagrees with the "
                              f"process group (rank {dist.get_rank()} of {dist.get_world_size()})")
    if config.backend == "fsdp2":
        from rlgraph.ops.train.engine.fsdp2_backend import FSDP2Engine

        return FSDP2Engine(model, config, rank, world_size)
    if config.backend == "deepspeed":
        from rlgraph.ops.train.engine.deepspeed_backend import DeepSpeedEngine

        return DeepSpeedEngine(model, config, rank, world_size)
    from rlgraph.ops.train.engine.torch_backend import TorchEngine

    return TorchEngine(model, config, rank, world_size)
