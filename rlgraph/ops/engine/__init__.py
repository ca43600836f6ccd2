"""The training engine behind update_actor and update_critic: one per data-parallel rank.

An engine holds a model, an AdamW optimizer, an LR schedule and, for dp > 1, the group's process
group; `TrainEngine.train` runs one training step (epochs x mini-batches x micro-batches) with
losses normalised by global token counts, so dp ranks together compute exactly what one rank
would on the whole batch. Backends: plain torch (DDP) and DeepSpeed (ZeRO 0-3).

    init_distributed(rank, world_size, master_port=port)        # each Ray actor, same port
    engine = TrainEngine.create(model, EngineConfig(lr=1e-6), rank, world_size)
    metrics = engine.train(batch, loss_fn, mini_batch_size=8, micro_batch_size=2, epochs=1)
    weights = engine.weights()                                   # to the rollout engine
"""

from rlgraph.ops.engine.base import STATE_FORMAT, LossFn, TrainEngine
from rlgraph.ops.engine.config import EngineConfig, EngineError, lr_factor
from rlgraph.ops.engine.dist import free_port, init_distributed

__all__ = ["EngineConfig", "EngineError", "LossFn", "STATE_FORMAT", "TrainEngine", "free_port",
           "init_distributed", "lr_factor"]
