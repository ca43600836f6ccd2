"""algorithm.use_kl_in_reward=true needs 'ref_log_prob', but the pipeline has no stages.ref()."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline(
    "kl_in_reward_without_ref",
    stages.prompt_source(),
    [stages.generate(), stages.reward(group="actor"), stages.old_logprob(),
     stages.advantage("grpo", group="actor"), stages.update_actor()],
    [WorkerGroup("actor")],
    config={"algorithm": {"use_kl_in_reward": True}},
)
