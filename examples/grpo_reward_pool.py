"""GRPO with its rule reward on a pool of reward workers of their own: the layout for a cluster.

``grpo.py``'s task, model and algorithm, derived from it with the DSL's ``with_*`` methods: the
reward and the advantage move from the policy's group to a worker group ``reward`` (a CPU each,
``groups.reward.dp`` workers). Scoring then runs beside the policy's passes, not inside them: what
a slow reward needs (a sandbox, a judge, a checker that takes seconds), and, on a cluster, it
spreads over the nodes (``groups.reward.placement=strict_spread``), each worker reading the rows
of its node. Each call of the pool still reads its rows from the data plane and writes the scores
back, and each worker is a process to start: on one small machine with a rule reward,
``grpo.py``'s layout is faster (docs/performance.md, section 11).

    rlgraph run examples/grpo_reward_pool.py -o runs/grpo_pool
    rlgraph run examples/grpo_reward_pool.py -o runs/grpo_pool --address auto cluster.num_nodes=3 \\
        groups.reward.dp=3 groups.reward.placement=strict_spread
"""

import sys
from dataclasses import replace
from pathlib import Path

from rlgraph import WorkerGroup
from rlgraph.ops import stages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo import pipeline as grpo  # noqa: E402  (its prepare hook builds and warm-starts the model)

pipeline = replace(
    grpo.with_ops(stages.reward(group="reward"), stages.advantage("grpo", group="reward"))
    .with_groups(WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: rollout, old log-probs, reference, update"),
                 WorkerGroup("reward", dp=1, num_cpus=1, doc="rule-based reward, then the advantage (CPU math)")),
    name="grpo_reward_pool",
)
