"""actor.use_kl_loss=true needs 'ref_log_prob', but the pipeline has no reference (stages.ref)."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "kl_loss_without_ref",
    stages.prompt_source(),
    [stages.generate(), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor")],
    config={"actor": {"use_kl_loss": True}},
)
