"""`stages.reward(group="rewards")` names a group that is declared as 'reward'."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("stage_group_typo", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="rewards"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor"), WorkerGroup("reward")])
