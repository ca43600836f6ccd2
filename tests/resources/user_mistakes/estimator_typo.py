"""`stages.advantage("gpro")`: a typo of the estimator 'grpo'."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("estimator_typo", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.advantage("gpro", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")])
