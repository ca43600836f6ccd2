"""`with_ops(drop=["refs"])` names an op the pipeline does not have (a typo of 'ref')."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

base = Pipeline("drop_names_nothing", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.ref(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")])
pipeline = base.with_ops(drop=["refs"])
