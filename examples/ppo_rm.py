"""PPO with a mixed reward: a rule (exact answer) plus a trained reward model (RM).

The pipeline is examples/ppo.py's (actor, critic, GAE, KL in the reward, task ``add``: "3+4=" ->
"7") with its reward made of two sources, each computed by its own op and combined per sample:

- ``rule_reward`` (`stages.reward`): 1 for an exact answer, 0 otherwise -> column ``rule_scores``;
- ``reward_model`` (`stages.reward_model`): a tiny trained sequence classifier scores each
  prompt+response -> column ``rm_scores`` (a logit: positive for answers it believes right);
- ``combine_rewards``: ``token_level_scores = 1.0 * rule_scores + 0.5 * rm_scores``, what the
  advantage reads. The weights are params: ``combine_rewards.w_rm_scores=0.2``, say.

The RM's weight is 0.5: its scores are logits (positive for answers it believes right, a few
units negative for wrong ones; the batch mean starts near -1.5), so at 0.5 it adds a dense
signal that separates near misses from malformed answers without outweighing the rule's 1 for a
correct answer; a much larger weight lets the policy optimise the RM more than the task.

Before the first run, ``prepare`` builds the tiny warm-started policy (``actor.model_path``) and
the tiny RM (``reward_model.model_path``): the same architecture and character tokenizer (an RM
reads the policy's token ids), warm started on the task, then trained for a few hundred steps to
tell correct answers from wrong ones (about 20-60 s on 2 CPU cores, once; cached under
``~/.cache/rlgraph/models/``).

Placement. By default the RM has its own worker group and pool (``rm``), so scoring runs on its
own worker beside generation and the other forward passes. To colocate it with the policy (share
the actor's devices: on a GPU the RM then sleeps on the CPU between calls,
``reward_model.offload``), either put its group on the actor's pool, a config override:

    rlgraph run examples/ppo_rm.py -o runs/ppo_rm groups.rm.pool=actor

(the rm group keeps its own worker, placed in the actor's bundles, which the two groups
time-share), or declare the op on the actor group itself,
``stages.reward_model(group="actor", score_column="rm_scores")`` (the actor's workers then also
hold the RM), and drop the ``rm`` group.

Metrics (``metrics.jsonl``): ``combine_rewards/combine_rewards_metrics/<column>/mean`` per source
(the rule's mean reads as accuracy; the RM's mean logit rises as the answers improve) and
``.../<column>/weight``; ``rule_reward/rule_reward_metrics/*`` (scored, error, timeout counts,
latency); ``score/mean`` is the combined score.

    rlgraph compile examples/ppo_rm.py -o build/ppo_rm
    rlgraph run examples/ppo_rm.py -o runs/ppo_rm
    rlgraph describe examples/ppo_rm.py groups.rm.pool=actor
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

MODEL = "~/.cache/rlgraph/models/tiny-add-ppo-v2"  # the same warm-started policy as examples/ppo.py
REWARD_MODEL = "~/.cache/rlgraph/models/tiny-add-rm"
SFT_STEPS = 100
RM_STEPS = 300
RM_WEIGHT = 0.5


def prepare(config):
    """Build the tiny policy and the tiny reward model once (rlgraph run calls this before starting)."""
    from rlgraph.ops.reward.model import prepare_tiny_reward_model
    from rlgraph.ops.tiny import prepare_tiny_policy

    task, seed = config["data"]["task"], config["trainer"]["seed"]
    prepare_tiny_policy(config["actor"]["model_path"], task, SFT_STEPS, seed=seed)
    prepare_tiny_reward_model(config["reward_model"]["model_path"], task, steps=RM_STEPS, seed=seed)


pipeline = Pipeline(
    name="ppo_rm",
    source=stages.prompt_source(),
    ops=[
        stages.generate(group="actor"),
        stages.reward(name="rule_reward", score_column="rule_scores", group="reward"),
        stages.reward_model(group="rm", score_column="rm_scores"),
        stages.combine_rewards({"rule_scores": 1.0, "rm_scores": RM_WEIGHT}, group="reward"),
        stages.old_logprob(group="actor"),
        stages.ref(group="actor"),
        stages.values(group="critic"),
        stages.advantage("gae", group="advantage"),
        stages.update_critic(group="critic"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: rollout, old log-probs, reference, update"),
        WorkerGroup("critic", dp=1, num_cpus=1, doc="value model: values and its update"),
        WorkerGroup("rm", dp=1, num_cpus=1, doc="reward model (own pool; groups.rm.pool=actor colocates it)"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="rule reward and the weighted combination"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantage estimation (CPU math)"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 32, "task": "add"},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 32, "micro_batch_size": 64},
        "algorithm": {"use_kl_in_reward": True, "kl_coef": 0.001},
        "critic": {"lr": 5e-4, "mini_batch_size": 32, "micro_batch_size": 64},
        "reward_model": {"model_path": REWARD_MODEL, "micro_batch_size": 32},
        "old_logprob": {"micro_batch_size": 32},
        "ref": {"micro_batch_size": 32},
        "values": {"micro_batch_size": 32},
        "trainer": {"steps": 300},
    },
    outputs=["token_level_rewards", "rule_reward_extra"],
    prepare=prepare,
    summaries=stages.SUMMARIES,
    validation=stages.VALIDATION,
)
