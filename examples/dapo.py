"""DAPO on a tiny language model: GRPO with dynamic sampling, overlong shaping and clip-higher.

The four changes DAPO (Yu et al., 2025) makes to GRPO, each a built-in op or setting:

- **dynamic sampling**: `filter_groups` drops every group whose samples all scored the same
  (their group-relative advantage is zero), and each step generates more prompts, up to
  ``filter_groups.max_rounds`` rounds, until the kept groups fill the batch;
- **overlong reward shaping**: `overlong_penalty` subtracts a linear penalty from responses that
  run into the last ``overlong.buffer_len`` tokens before ``rollout.max_new_tokens``;
- **clip-higher**: ``actor.clip_ratio_high`` (0.28) above ``actor.clip_ratio_low`` (0.2);
- **token-level loss** (``actor.loss_agg_mode=token-mean``) and no KL term (no reference model).

The task (``data.task``, default ``add``: "3+4=" -> "7") is generated; the rule reward is 1 for a
correct answer and 0 otherwise. ``score`` is the shaped score of the trained samples, ``acc`` the
rule score; ``generated/acc/mean`` is the accuracy over every sample generated in the step (the
trained ones are, by design, groups that were neither all right nor all wrong).

    rlgraph run examples/dapo.py -o runs/dapo
    rlgraph compile examples/dapo.py -o build/dapo
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

MODEL = "~/.cache/rlgraph/models/tiny-add-grpo-v2"  # the GRPO example's warm-started model
SFT_STEPS = 100


def prepare(config):
    """Build and warm start the tiny policy once (rlgraph run calls this before starting)."""
    from rlgraph.ops.tiny import prepare_tiny_policy

    prepare_tiny_policy(config["actor"]["model_path"], config["data"]["task"], SFT_STEPS,
                        seed=config["trainer"]["seed"])


pipeline = Pipeline(
    name="dapo",
    source=stages.prompt_source(),
    ops=[
        stages.generate(group="actor"),
        stages.reward(group="reward", score_column="rule_scores"),
        stages.overlong_penalty("rule_scores", output_column="shaped_scores", group="reward"),
        stages.filter_groups("shaped_scores", metric_column="rule_scores", group="reward"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="advantage"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: rollout, old log-probs, update"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="rule reward, overlong shaping, group filter"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantage estimation (CPU math)"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 16, "task": "add"},
        "rollout": {"n": 8, "max_new_tokens": 4, "temperature": 1.0},
        "overlong": {"buffer_len": 2, "penalty_factor": 0.5},
        "filter_groups": {"max_rounds": 3, "on_exhaust": "train"},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 16, "micro_batch_size": 64,
                  "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
        "old_logprob": {"micro_batch_size": 64},
        "trainer": {"steps": 300},
    },
    prepare=prepare,
    summaries={**stages.SUMMARIES, "rule_scores": "acc"},
    validation=("rule_scores",),  # the rule score of every validation sample (the filter would drop some)
)
