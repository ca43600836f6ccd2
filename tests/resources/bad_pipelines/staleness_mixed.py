"""trainer.max_staleness=1 with old_logprob in the rollout group: generate there may read the weights
a step old, old_logprob must read the latest, and a group holds one copy."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "staleness_mixed",
    stages.prompt_source(),
    [stages.generate(group="rollout"), stages.reward(group="actor"), stages.old_logprob(group="rollout"),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor"), WorkerGroup("rollout")],
    config={"trainer": {"max_staleness": 1}},
)
