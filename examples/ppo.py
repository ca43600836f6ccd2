"""PPO with GAE and a critic on a tiny language model: the classic actor-critic pipeline.

The task (``data.task``, default ``add``: "3+4=" -> "7") is generated in verl's data layout;
the reward is 1 for a correct answer and 0 otherwise, so the mean reward reads as accuracy.
Before the first run, ``prepare`` builds a tiny Qwen2-style model with a character tokenizer
and gives it a short, open supervised warm start (cached in ``actor.model_path``); the critic
starts from the same backbone with a fresh value head.

The reward is penalised by KL(policy || reference) per token (``algorithm.use_kl_in_reward``),
as in classic RLHF PPO; the reference model is needed for that alone.

Worker groups: the actor group holds generation, the old-logprob and reference forward passes
and the actor update on the same workers (colocation); the critic has its own group; rewards
and the advantage math run on small CPU groups.

    rlgraph run examples/ppo.py -o runs/ppo
    rlgraph compile examples/ppo.py -o build/ppo
    rlgraph describe examples/ppo.py data.batch_size=45 rollout.n=8 groups.actor.dp=2
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

MODEL = "~/.cache/rlgraph/models/tiny-add-ppo-v2"
SFT_STEPS = 100


def prepare(config):
    """Build and warm start the tiny policy once (rlgraph run calls this before starting)."""
    from rlgraph.ops.tiny import prepare_tiny_policy

    prepare_tiny_policy(config["actor"]["model_path"], config["data"]["task"], SFT_STEPS,
                        seed=config["trainer"]["seed"])


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
        "data": {"batch_size": 32, "task": "add"},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 32, "micro_batch_size": 64},
        "algorithm": {"use_kl_in_reward": True, "kl_coef": 0.001},
        "critic": {"lr": 5e-4, "mini_batch_size": 32, "micro_batch_size": 64},
        "old_logprob": {"micro_batch_size": 32},
        "ref": {"micro_batch_size": 32},
        "values": {"micro_batch_size": 32},
        "trainer": {"steps": 300},
    },
    outputs=["token_level_rewards", "reward_extra"],
    prepare=prepare,
    summaries=stages.SUMMARIES,
    validation=stages.VALIDATION,
)
