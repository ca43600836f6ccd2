"""rollout.partial=true without trainer.max_staleness: generate always holds the newest weights,
so none can arrive while it runs."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "partial_unused",
    stages.prompt_source(),
    [stages.generate(group="rollout"), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor"), WorkerGroup("rollout")],
    config={"rollout": {"partial": True}},
)
