"""On-policy distillation on the addition task: a student learns from a stronger teacher's next-token distributions.

The student is the tiny 4-layer model after a short warm start (100 steps); the teacher is the same model
warm-started eight times longer (800 steps), so it shares the student's character tokenizer. The
student samples; the teacher scores every response position (``stages.teacher_logprob``) and, with
``teacher.top_k``, writes its most likely next tokens and their log-probs. The update then adds
GKD's divergence between the student's and the teacher's distributions at every sampled position
(``actor.distill_coef``, ``actor.distill_beta``: 0.5 is the Jensen-Shannon divergence), and the
advantage (``stages.advantage("distill")``) carries no sampled-token term (``algorithm.distill_kl_weight=0``).
Each step samples 64 prompts x 2 (GRPO's 16 x 8 is as many samples: the teacher's signal needs no group to
compare against). The rule reward still runs: it is what the run reports as accuracy, and
``algorithm.distill_task_weight=W`` mixes its GRPO advantage in. ``grpo`` below is the same student trained by GRPO alone, for
comparison (docs/examples.md has the chart over 3 seeds).

    rlgraph run examples/distill.py -o runs/distill                                  # distillation (GKD)
    rlgraph run examples/distill.py -o runs/distill_mix algorithm.distill_task_weight=1
    rlgraph run examples/distill.py:grpo -o runs/distill_grpo                        # GRPO alone
    rlgraph run examples/distill.py -o runs/distill_sampled teacher.top_k=0 actor.distill_coef=0 \
        algorithm.distill_kl_weight=1          # the sampled-token reverse-KL advantage (Thinking Machines' recipe)
    rlgraph run examples/distill.py -o runs/distill_vllm teacher.backend=vllm   # the teacher on vLLM
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

STUDENT = "~/.cache/rlgraph/models/tiny-add-student-v3"
TEACHER = "~/.cache/rlgraph/models/tiny-add-teacher-v1"
STUDENT_SFT_STEPS, TEACHER_SFT_STEPS = 100, 800
SHAPE = dict(hidden_size=128, num_layers=4)  # both models: the teacher is the student trained further


def prepare(config):
    """Build both models once (cached): the student barely warm-started, the teacher trained longer."""
    from rlgraph.ops.tiny import prepare_tiny_policy

    prepare_tiny_policy(config["actor"]["model_path"], config["data"]["task"], STUDENT_SFT_STEPS, seed=0, **SHAPE)
    if config.get("teacher"):
        prepare_tiny_policy(config["teacher"]["model_path"], config["data"]["task"], TEACHER_SFT_STEPS, seed=0,
                            **SHAPE)


def _pipeline(name: str, distill: bool) -> Pipeline:
    ops = [stages.generate(group="actor"), stages.reward(group="reward"), stages.old_logprob(group="actor")]
    groups = [WorkerGroup("actor", dp=1, num_cpus=1, doc="the student: rollout, log-probs, update"),
              WorkerGroup("reward", dp=1, num_cpus=0.5, doc="rule-based reward (the accuracy)"),
              WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="advantages (CPU math)")]
    config = {
        "data": {"batch_size": 16, "task": "add"},
        "rollout": {"n": 8, "max_new_tokens": 4, "temperature": 1.0},
        "actor": {"model_path": STUDENT, "lr": 3e-4, "mini_batch_size": 16, "micro_batch_size": 64},
        "old_logprob": {"micro_batch_size": 64},
        "trainer": {"steps": 150},
    }
    if distill:
        ops += [stages.teacher_logprob(group="teacher"), stages.advantage("distill", group="advantage")]
        groups.insert(1, WorkerGroup("teacher", dp=1, num_cpus=1, doc="the teacher's distributions at the samples"))
        # top_k 64 is the whole distribution of this 57-token vocabulary; for a real model, 20-100 of its tokens
        config["teacher"] = {"model_path": TEACHER, "micro_batch_size": 64, "top_k": 64}
        config["actor"].update(distill_coef=1.0, distill_beta=0.5)
        config["algorithm"] = {"distill_kl_weight": 0.0}
        # the same 128 samples a step as GRPO's 16 x 8, over 4x the prompts: the teacher's signal is per token and
        # needs no group of samples to compare against, so the samples go to more prompts instead
        config["data"]["batch_size"], config["rollout"]["n"], config["actor"]["mini_batch_size"] = 64, 2, 64
    else:
        ops += [stages.advantage("grpo", group="advantage")]
    return Pipeline(
        name=name,
        source=stages.prompt_source(),
        ops=[*ops, stages.update_actor(group="actor")],
        groups=groups,
        cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
        config=config,
        prepare=prepare,
        summaries=stages.SUMMARIES,
        validation=stages.VALIDATION,
    )


pipeline = _pipeline("distill", distill=True)
grpo = _pipeline("distill_grpo", distill=False)
