"""Training: the workers that hold a trained model, and the engine that updates it.

`actor` holds `ActorWorker` (generation, old and reference log-probs, the PPO update, on one
model per rank), `critic` `CriticWorker` (values and the value update); `update` the glue
between their update ops and the engine (`TrainerMixin`, sizes from ``ctx.batching``);
`sequences` packs ragged rows into the padded batches a forward pass takes; `logprobs` scores
responses a chunk of logits at a time, padded or packed; `lora` puts peft adapters on the policy;
`engine/` is the training engine itself (torch DDP, DeepSpeed ZeRO or FSDP2, micro-batches by rows
or token budget). The loss math is in `rlgraph.ops.algos`.
"""
