"""GRPO on a model of a real model's shape: Qwen2.5-0.5B's architecture and 151,936-token vocabulary.

No download: ``prepare`` saves a random-initialised model of that shape (about 1 GB, bfloat16 on
disk, float32 in the workers) with the tiny models' character tokenizer, so every cost is a real
0.5B-class model's (the embedding and output head of a 152k vocabulary dominate the small ones)
while the rewards mean nothing (a random model answers at random). It is the config the
performance doc's section 16 measures; on CPU a step takes about a minute.

    rlgraph run examples/grpo_real_shape.py -o runs/shape --steps 2                  # torch, dp=1, full FT
    rlgraph run examples/grpo_real_shape.py -o runs/shape_opt --steps 2 \\
        groups.actor.dp=2 actor.backend=fsdp2 actor.packing=true \\
        actor.max_tokens_per_micro_batch=2048 actor.lora_rank=16 actor.lora_alpha=32      # FSDP2 + packing + LoRA

On a GPU, give the actor group one (``groups.actor.num_gpus=1``): models go to it, the reference in
bfloat16, and FSDP2 computes in bfloat16 (``actor.mixed_precision=auto``).
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

MODEL = "~/.cache/rlgraph/models/qwen2.5-0.5b-shape-random"


def prepare(config):
    """Save the random-initialised model once (rlgraph run calls this before starting)."""
    from rlgraph.ops.models import build_once, build_shaped_model

    build_once(config["actor"]["model_path"],
               lambda tmp: build_shaped_model(tmp, "qwen2.5-0.5b", seed=config["trainer"]["seed"]))


pipeline = Pipeline(
    name="grpo_real_shape",
    source=stages.prompt_source(),
    ops=[
        stages.generate(group="actor"),
        stages.reward(group="reward"),
        stages.old_logprob(group="actor"),
        stages.ref(group="actor"),
        stages.advantage("grpo", group="advantage"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=2, doc="policy: rollout, old log-probs, reference, update"),
        WorkerGroup("reward", dp=1, num_cpus=0.5, doc="rule-based reward workers"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantage estimation (CPU math)"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 2, "task": "add"},
        "rollout": {"n": 4, "max_new_tokens": 16, "temperature": 1.0},
        "actor": {"model_path": MODEL, "lr": 1e-6, "mini_batch_size": 2, "micro_batch_size": 4,
                  "use_kl_loss": True, "kl_loss_coef": 0.001, "gradient_checkpointing": True},
        "trainer": {"steps": 2},
    },
    prepare=prepare,
    summaries=stages.SUMMARIES,
    validation=stages.VALIDATION,
)
