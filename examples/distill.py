"""On-policy distillation on the addition task: a weak student learns from a stronger teacher's log-probs.

The student (the tiny 2-layer model with the GRPO example's short warm start) samples; the teacher (a 4-layer model
warm-started much longer, with the same character tokenizer) scores each sampled token
(``stages.teacher_logprob``); the advantage of every token is the per-token reverse KL to the
teacher, ``log p_teacher - log p_student`` (``stages.advantage("distill")``). The rule reward still
runs: it is what the run reports as accuracy, and ``algorithm.distill_task_weight=W`` mixes its
GRPO advantage in. ``grpo`` below is the same student trained by GRPO alone, for comparison
(docs/examples.md has the chart over 3 seeds).

    rlgraph run examples/distill.py -o runs/distill                                  # distillation
    rlgraph run examples/distill.py -o runs/distill_mix algorithm.distill_task_weight=1
    rlgraph run examples/distill.py:grpo -o runs/distill_grpo                        # GRPO alone
    rlgraph run examples/distill.py -o runs/distill_vllm teacher.backend=vllm         # the teacher on vLLM
"""

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages

STUDENT = "~/.cache/rlgraph/models/tiny-add-student-v2"
TEACHER = "~/.cache/rlgraph/models/tiny-add-teacher-v1"
STUDENT_SFT_STEPS, TEACHER_SFT_STEPS = 100, 800


def prepare(config):
    """Build both models once (cached): the student barely warm-started, the teacher larger and trained longer."""
    from rlgraph.ops.tiny import prepare_tiny_policy

    prepare_tiny_policy(config["actor"]["model_path"], config["data"]["task"], STUDENT_SFT_STEPS, seed=0)
    if config.get("teacher"):
        prepare_tiny_policy(config["teacher"]["model_path"], config["data"]["task"], TEACHER_SFT_STEPS, seed=0,
                            hidden_size=128, num_layers=4)


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
        "trainer": {"steps": 80},
    }
    if distill:
        ops += [stages.teacher_logprob(group="teacher"), stages.advantage("distill", group="advantage")]
        groups.insert(1, WorkerGroup("teacher", dp=1, num_cpus=1, doc="the teacher's log-probs of the samples"))
        config["teacher"] = {"model_path": TEACHER, "micro_batch_size": 64}
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
