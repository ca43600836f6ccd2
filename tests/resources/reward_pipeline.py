"""Reward serving on Ray without a policy model: a scripted generator feeds a pool of reward workers.

``generate`` answers each prompt of the built-in ``add`` task; sample i of a group answers
correctly unless ``generate.wrong_every`` divides i+1, and each call sleeps ``generate.delay_s``
(so reward calls can overlap with generation under ``stream``). The reward functions in
`reward_fns.py` (next to this file) score, raise, or stall depending on the ground truth, so
every failure policy can be exercised. GRPO advantages need every sample of a group scored.
"""

import time
from pathlib import Path

import torch

from rlgraph import Cluster, Pipeline, T, WorkerGroup, op
from rlgraph.ops import stages
from rlgraph.ops.models import char_tokenizer
from rlgraph.ops.rollout.parts import response_columns

FNS = str(Path(__file__).with_name("reward_fns.py"))
GEN_OUT = {c: stages.COLUMNS[c] for c in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                          "position_ids")}
_TOK = []


@op(outputs=GEN_OUT, granularity="group", group="actor", group_size_param="n")
def generate(prompt_ids: stages.COLUMNS["prompt_ids"], ground_truth: T.str(), *, n: int = 4,
             wrong_every: int = 0, delay_s: float = 0.0, micro_batch_size: int = 2, ctx=None):
    if not _TOK:
        _TOK.append(char_tokenizer())
    tok = _TOK[0]
    time.sleep(delay_s)
    lengths = ctx.lengths["prompt_len"]
    prompts = [prompt_ids[i, :lengths[i]] for i in range(len(lengths))]
    responses = []
    for i, gt in enumerate(ground_truth):
        answer = gt if not (wrong_every and (i % n + 1) % wrong_every == 0) else gt + "9"
        responses.append(torch.tensor(tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]))
    out = response_columns(prompts, responses, ctx.is_padding, None)
    return {k: out[k] for k in GEN_OUT}


pipeline = Pipeline(
    name="rewards",
    source=stages.prompt_source(),
    ops=[
        generate,
        stages.reward(group="reward"),
        stages.advantage("grpo", group="adv"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=0.5),
        WorkerGroup("reward", dp=3, num_cpus=0.25, placement="spread"),
        WorkerGroup("adv", dp=1, num_cpus=0.25),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8),
    config={
        "data": {"batch_size": 6, "task": "add", "num_rows": 64, "tokenizer": "char"},  # no policy to take one from
        "generate": {"n": 4},
        "reward": {"micro_batch_size": 2},
        "trainer": {"steps": 1},
    },
    outputs=["advantages", "reward_extra"],
    summaries=stages.SUMMARIES,
    validation=stages.VALIDATION,
)
