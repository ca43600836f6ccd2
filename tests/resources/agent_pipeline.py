"""GRPO with a multi-turn environment: the agent op, the environment's reward, GRPO, the update."""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    name="agent_guess",
    source=stages.prompt_source(),
    ops=[
        stages.agent_rollout(env="tests.resources.agent_envs:GuessNumber", group="actor"),
        stages.env_reward(group="reward"),
        stages.advantage("grpo", group="reward"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1),
        WorkerGroup("reward", dp=1, num_cpus=1),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 4, "task": "add", "num_rows": 64},
        "rollout": {"n": 4, "max_new_tokens": 4, "max_turns": 3, "max_response_tokens": 24},
        "actor": {"mini_batch_size": 4, "lr": 1e-3},
    },
    summaries=stages.SUMMARIES,
)
