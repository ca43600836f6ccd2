"""`actor.lr` given as a string that is no number."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("lr_string", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")], config={"actor": {"lr": "1e-4x"}})
