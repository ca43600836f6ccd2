"""The stage factory `stages.generate` passed uncalled in ops=."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("factory_uncalled", stages.prompt_source(), [
        stages.generate,
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")])
