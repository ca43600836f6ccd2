"""`WorkerGroup("reward", pool="actr")`: a typo of the group 'actor' whose devices it should share."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("pool_names_nothing", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="reward"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor"), WorkerGroup("reward", pool="actr")])
