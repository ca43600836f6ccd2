"""GAE advantages need critic 'values', but the pipeline has no critic (stages.values)."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "gae_without_critic",
    stages.prompt_source(),
    [stages.generate(), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("gae", group="actor"), stages.update_actor()],
    [WorkerGroup("actor")],
)
