"""trainer.max_staleness=1 with generate in the actor's group: it would generate with weights that
update_actor changes in place, so it cannot run a step behind them."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "staleness_colocated",
    stages.prompt_source(),
    [stages.generate(group="actor"), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor")],
    config={"trainer": {"max_staleness": 1}},
)
