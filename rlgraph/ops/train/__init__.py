"""Training: the workers that hold a trained model, and the engine that updates it.

`actor` holds `ActorWorker` (generation, old and reference log-probs, the PPO update, on one
model per rank), `critic` `CriticWorker` (values and the value update); `update` the glue
between their update ops and the engine (`TrainerMixin`, sizes from ``ctx.batching``);
`sequences` packs ragged rows into the padded batches a forward pass takes; `engine/` is the
training engine itself (torch DDP or DeepSpeed ZeRO). The loss math is in `rlgraph.ops.algos`.
"""
