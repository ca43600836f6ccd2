"""Rollout: how the generate op turns a rank's prompts into responses, streamed per part.

`parts` holds the generation loops on both backends (transformers ``generate`` per micro-batch,
or a vLLM engine with a part per finished group), the generate op's output columns and its
padding rows; `vllm_engine` holds `VLLMEngine`, one vLLM engine per rollout rank (weights loaded
in place, sleep/wake on a shared GPU, a dead engine restarted). The op body that calls them is
`ActorWorker.generate` in `rlgraph.ops.train.actor`, which owns the policy model.
"""
