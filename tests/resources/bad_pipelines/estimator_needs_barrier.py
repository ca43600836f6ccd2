"""The advantage op is declared per group (GRPO) but configured as REINFORCE++, which whitens
over the whole batch and so must be a barrier."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "estimator_needs_barrier",
    stages.prompt_source(),
    [stages.generate(), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor")],
    config={"algorithm": {"estimator": "reinforce_plus_plus"}},
)
