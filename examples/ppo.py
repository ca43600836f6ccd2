"""PPO with GAE and a critic: the classic actor-critic pipeline of verl's PPO trainer.

The reward is penalised by KL(policy || reference) per token (``algorithm.use_kl_in_reward``),
as in classic RLHF PPO; the reference model is needed for that alone.

Worker groups: the actor group holds generation, the old-logprob and reference forward passes
and the actor update on the same workers (colocation); the critic has its own group; rewards
and the advantage math run on small CPU groups.

    rlgraph compile examples/ppo.py -o build/ppo
    rlgraph describe examples/ppo.py data.batch_size=45 rollout.n=8 groups.actor.dp=2
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    name="ppo",
    source=stages.prompt_source(),
    ops=[
        stages.generate(group="actor"),
        stages.reward(group="reward"),
        stages.old_logprob(group="actor"),
        stages.ref(group="actor"),
        stages.values(group="critic"),
        stages.advantage("gae", group="advantage"),
        stages.update_critic(group="critic"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: rollout, old log-probs, reference, update"),
        WorkerGroup("critic", dp=1, num_cpus=1, doc="value model: values and its update"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="rule-based reward workers"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantage estimation (CPU math)"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 16},
        "actor": {"lr": 1e-4, "mini_batch_size": 4},
        "algorithm": {"use_kl_in_reward": True, "kl_coef": 0.01},
        "critic": {"lr": 1e-4, "mini_batch_size": 4},
        "trainer": {"steps": 20},
    },
    outputs=["token_level_rewards", "reward_extra"],
)
