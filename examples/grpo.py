"""GRPO: no critic; advantages are group-normalised scores, computed per group of n samples.

The advantage op runs per group, so each prompt's n responses are scored and normalised as
soon as they all exist, while the rest of the batch is still generating.

    rlgraph compile examples/grpo.py -o build/grpo
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    name="grpo",
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
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: rollout, old log-probs, reference, update"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="rule-based reward workers"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantage estimation (CPU math)"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 8},
        "rollout": {"n": 8, "max_new_tokens": 16},
        "actor": {"lr": 1e-4, "mini_batch_size": 4, "use_kl_loss": True},
        "trainer": {"steps": 20},
    },
)
