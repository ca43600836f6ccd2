"""GRPO on a tiny language model: no critic; advantages are group-normalised scores.

The task (``data.task``, default ``add``: "3+4=" -> "7") is generated in verl's data layout;
the reward is 1 for a correct answer and 0 otherwise, so the mean reward reads as accuracy.
Before the first run, ``prepare`` builds a tiny Qwen2-style model with a character tokenizer
and gives it a short, open supervised warm start (cached in ``actor.model_path``).

Every op runs on the policy's worker group, which holds both cores of a small machine: the
rule-based reward, the reference pass and the advantage ride inside generation's call (a fused
chain), reading its outputs from the worker's memory, as a single-process trainer would. A reward
worker of its own would cost a process to start and a data-plane round trip per call for a
scoring that takes microseconds (docs/performance.md, section 11). On a cluster, or with a slow
reward (a sandbox, a judge model), give the reward a group of its own so that it overlaps the
policy's passes, as examples/ppo.py does: ``stages.reward(group="reward")`` with a
``WorkerGroup("reward", ...)``.

    rlgraph run examples/grpo.py -o runs/grpo
    rlgraph run examples/grpo.py -o runs/grpo_vllm rollout.backend=vllm   # after setup.sh --vllm=cpu
    rlgraph compile examples/grpo.py -o build/grpo
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

MODEL = "~/.cache/rlgraph/models/tiny-add-grpo-v2"
SFT_STEPS = 100
# Forward and backward passes as large as a token budget allows, not a fixed 64 samples: a tiny
# model's passes on a CPU are bound by per-operation overhead, so one pass over 512 samples takes
# about a quarter less than eight over 64 (docs/performance.md, section 11). With a real model,
# size max_tokens_per_micro_batch to the device's memory (verl: log_prob_max_token_len_per_gpu,
# ppo_max_token_len_per_gpu).
PASSES = {"micro_batch_size": 1024, "max_tokens_per_micro_batch": 16384}


def prepare(config):
    """Build and warm start the tiny policy once (rlgraph run calls this before starting)."""
    from rlgraph.ops.tiny import prepare_tiny_policy

    prepare_tiny_policy(config["actor"]["model_path"], config["data"]["task"], SFT_STEPS,
                        seed=config["trainer"]["seed"])


pipeline = Pipeline(
    name="grpo",
    source=stages.prompt_source(),
    ops=[
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.ref(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=2, doc="policy: rollout, rule-based reward, old log-probs, reference, "
                    "advantage, update"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 16, "task": "add"},
        "rollout": {"n": 8, "max_new_tokens": 4, "temperature": 1.0},
        # the built-in scorer compares two strings and cannot stall: no time limit, so a call scores on
        # its own thread, as a single-process trainer does (a hand-off to the scoring threads and back
        # costs more than scoring 128 answers; docs/operators.md, reward.timeout_s)
        "reward": {"timeout_s": 0},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 16, **PASSES,
                  "use_kl_loss": True, "kl_loss_coef": 0.001},
        "old_logprob": PASSES,
        "ref": PASSES,
        "trainer": {"steps": 350},
    },
    prepare=prepare,
    summaries=stages.SUMMARIES,
    validation=stages.VALIDATION,
)
