"""`rollout.n = 0`: each prompt needs at least one sample."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("n_zero", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")], config={"rollout": {"n": 0}})
