"""Built-in declarations of the PPO/GRPO stages (BRIEF section 1): columns, granularity, params.

These are declarations only: each returns an `OpSpec` (or the `DataSource`) whose body is
referenced by import path and loaded by the runtime. Call them with another ``group=`` to
place a stage elsewhere, or ``.with_(...)`` the result to change anything else.

Column names follow verl's, so reward code and metrics carry over.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from rlgraph.errors import DeclarationError, Problem
from rlgraph.graph.columns import ColumnType, T
from rlgraph.graph.config import Param
from rlgraph.graph.dsl import SYSTEM_COLUMNS, Batching, DataSource, OpSpec
from rlgraph.ops.names import (AGG_MODES, ENGINE_BACKENDS, ESTIMATOR_NEEDS, ESTIMATORS, EXECUTORS, KL_KINDS, LOSS_MODES,
                                ON_ERROR)

__all__ = [
    "COLUMNS",
    "SUMMARIES",
    "VALIDATION",
    "prompt_source",
    "generate",
    "reward",
    "filter_groups",
    "reward_model",
    "combine_rewards",
    "overlong_penalty",
    "old_logprob",
    "ref",
    "values",
    "advantage",
    "update_critic",
    "update_actor",
]

P, R, S = "prompt_len", "response_len", "seq_len"

COLUMNS: Mapping[str, ColumnType] = MappingProxyType({
    # data source (one row per sample: each prompt repeated n times)
    "prompt_ids": T.int64(P, doc="prompt token ids, unpadded"),
    "data_source": T.str(doc="dataset name; selects the reward function"),
    "ground_truth": T.str(doc="reference answer for rule-based rewards"),
    "extra_info": T.json(doc="free-form per-sample info passed to compute_score"),
    # generate
    "prompts": T.int64(P, doc="prompt tokens as fed to the model"),
    "responses": T.int64(R, doc="sampled response tokens"),
    "response_mask": T.int64(R, doc="1 on response tokens up to and including EOS"),
    "input_ids": T.int64(S, doc="prompt + response"),
    "attention_mask": T.int64(S, doc="1 on real tokens of input_ids"),
    "position_ids": T.int64(S, doc="positions of input_ids"),
    "rollout_log_probs": T.float32(R, doc="log-probs of the sampled tokens under the rollout engine (computed when "
                                          "an op reads them)"),
    "rollout_metrics": T.json().metric(),
    "policy_version": T.int64(doc="updates the generating policy had seen (0: the initial weights); the update "
                              "trains on it only if at most trainer.max_staleness versions behind its own"),
    "policy_version_end": T.int64(doc="the policy version that generated the response's last token: above "
                                  "policy_version when new weights arrived while it was generated (rollout.partial)"),
    # reward
    "token_level_scores": T.float32(R, doc="the score, placed on the last response token"),
    "reward_extra": T.json(doc="extra values returned by the reward function"),
    # forward passes
    "old_log_probs": T.float32(R, doc="log-probs of responses under the current policy"),
    "entropy": T.float32(R, doc="per-token entropy of the current policy"),
    "ref_log_prob": T.float32(R, doc="log-probs of responses under the frozen reference"),
    "old_logprob_metrics": T.json().metric(),
    "values": T.float32(R, doc="critic values per response token"),
    # advantage
    "advantages": T.float32(R),
    "returns": T.float32(R),
    "token_level_rewards": T.float32(R, doc="scores minus the KL penalty when KL is in the reward"),
    "advantage_metrics": T.json().metric(),
    # updates
    "critic_metrics": T.json().metric(),
    "actor_metrics": T.json().metric(),
    "critic_weights": T.opaque(doc="critic parameters after the update").state(),
    "policy_weights": T.opaque(doc="policy parameters after the update").state(),
})


def _cols(*names: str) -> dict[str, ColumnType]:
    return {n: COLUMNS[n] for n in names}


_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")

# What a PPO/GRPO pipeline reports per step (Pipeline(summaries=...)): each column's per-row sum,
# as mean/max/min over real rows. The score is the headline (its mean is the reward curve).
SUMMARIES: Mapping[str, str] = MappingProxyType({
    "token_level_scores": "score",
    "token_level_rewards": "reward",
    "response_mask": "response_length",
})
# What validation produces (Pipeline(validation=...)): the scores of the validation prompts.
VALIDATION = ("token_level_scores",)


def prompt_source(**params: Param) -> DataSource:
    """Prompts in verl's layout (parquet/JSONL: ``prompt`` chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``), tokenised, each repeated n times.

    With an empty ``data.path`` the prompts of the built-in task ``data.task`` are generated
    (see `rlgraph.ops.data.tasks`). The body is `rlgraph.ops.data.prompts.PromptSource`."""
    return DataSource(
        columns=_cols("prompt_ids", "data_source", "ground_truth", "extra_info"),
        params={
            "path": Param(str, "", "parquet or JSONL file of prompts in verl's layout; empty: generate data.task"),
            "val_path": Param(str, "", "parquet or JSONL file of validation prompts (read in order); empty: the "
                                       "generated task's test split, or no validation when data.path is set"),
            "tokenizer": Param(str, "", "HF directory whose tokenizer and chat template encode the prompts (use "
                                        "the policy's); empty: the built-in character tokenizer of the tiny models"),
            "max_prompt_length": Param(int, 64, "longest prompt in tokens, chat template included", minimum=1),
            "filter_overlong_prompts": Param(bool, True, "drop (and count) prompts longer than max_prompt_length; "
                                                         "false: such a prompt is an error naming its row"),
            "shuffle": Param(bool, True, "shuffle prompts each epoch (seeded by trainer.seed and the epoch)"),
            "task": Param(str, "add", "built-in task generated when data.path is empty", choices=("add", "count")),
            "num_rows": Param(int, 1024, "train rows generated when data.path is empty", minimum=1),
            "num_val_rows": Param(int, 64, "validation rows generated when data.path and data.val_path are empty",
                                  minimum=1),
            "reader": Param(str, "auto", "how files are read: ray (Ray Data), local (pyarrow; JSONL line by line), "
                                         "auto (ray when Ray runs in the process with a CPU free, else local)",
                            choices=("auto", "ray", "local")),
            **params,
        },
        impl="rlgraph.ops.data.prompts:PromptSource",
    )


def _validate_generate(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    from rlgraph.ops.rollout.parts import parse_token_ids

    try:
        parse_token_ids(str(params.get("stop_token_ids", "")))
    except ValueError as e:
        return [Problem("op-config", str(e), "give token ids separated by commas, e.g. rollout.stop_token_ids=7,9")]
    return []


def generate(group: str = "actor", **changes: Any) -> OpSpec:
    """Sample n responses per prompt with the current policy: one call per rank with all of its prompts,
    each group handed on as soon as it is done (vLLM: continuous batching; hf: per micro-batch)."""
    return OpSpec(
        name="generate",
        inputs=_cols("prompt_ids", "policy_weights"),
        outputs=_cols("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                      "rollout_log_probs", "rollout_metrics", "policy_version", "policy_version_end"),
        granularity="group",
        group=group,
        config_key="rollout",
        params={
            "n": Param(int, 4, "responses sampled per prompt (the group size)", minimum=1),
            "backend": Param(str, "hf", "hf: transformers generate, a micro-batch at a time; vllm: a vLLM engine per "
                             "rank, continuous batching (install with scripts/setup.sh --vllm=cpu or rlgraph[vllm])",
                             choices=("hf", "vllm"), setup=True),
            "model_path": Param(str, "", "policy model directory for a generation-only group (default: actor.model_path)",
                                setup=True),
            "temperature": Param(float, 1.0, "sampling temperature (0: greedy)", minimum=0.0),
            "top_p": Param(float, 1.0, "nucleus sampling mass", minimum=0.0),
            "top_k": Param(int, 0, "sample from the k most likely tokens (0: off)", minimum=0),
            "max_new_tokens": Param(int, 16, "response length limit in tokens", minimum=1),
            "stop_token_ids": Param(str, "", "token ids that end a response besides EOS, comma-separated (e.g. '7,9')"),
            "micro_batch_size": Param(int, 16, "hf: prompts per transformers generate call (each call's samples are "
                                      "handed on when it ends); vllm: unused, the engine batches continuously",
                                      minimum=1),
            "dtype": Param(str, "auto", "vllm: weights' dtype (auto: the model's on a GPU, float32 on CPU)",
                           choices=("auto", "float32", "bfloat16", "float16"), setup=True),
            "max_model_len": Param(int, 0, "vllm: longest prompt + response in tokens (0: the model's own limit)",
                                   minimum=0, setup=True),
            "gpu_memory_utilization": Param(float, 0.5, "vllm on a GPU: share of its memory the engine may take",
                                            minimum=0.0, setup=True),
            "cpu_kv_cache_gb": Param(int, 1, "vllm on CPU: KV-cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)",
                                     minimum=1, setup=True),
            "enforce_eager": Param(bool, True, "vllm: run the model eagerly (no CUDA graphs or compilation: quick to "
                                   "start)", setup=True),
            "sleep_mode": Param(bool, True, "vllm on a GPU shared with the update: free the engine's memory during the "
                                "update and wake it before generating", setup=True),
            "partial": Param(bool, False, "partial rollout, with trainer.max_staleness >= 1: weights the update "
                             "writes while a generate call runs are loaded at once (vllm: between engine steps, so a "
                             "response may start under one policy version and finish under the next, recorded in "
                             "policy_version and policy_version_end; hf: between micro-batches). Fresher samples, "
                             "but which tokens each version made depends on timing: a resume does not repeat them "
                             "bit for bit"),
        },
        impl="rlgraph.ops.train.actor:ActorWorker.generate",
        group_size_param="n",
        batching=Batching(micro_batch="micro_batch_size", per_rank=True),
        streams=True,
        stale_ok=True,  # the behaviour policy: with trainer.max_staleness=k it runs up to k steps ahead
        validate=_validate_generate,
        cost=5.0,
        doc="Generate n responses per prompt, streaming each finished group; weights are synced from update_actor "
            "once per step.",
    ).with_(**changes)


def _validate_reward(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    """Load the reward function at compile time: a wrong path or signature fails `rlgraph compile`
    and `rlgraph validate`, not step 0 of a run after generation."""
    from rlgraph.ops.reward.functions import RewardFnError, load_reward_fn

    fn = params.get("fn")
    if not isinstance(fn, str):
        return []
    try:
        load_reward_fn(fn)
    except RewardFnError as e:
        return [Problem("op-config", str(e), "point <op>.fn at 'module:function' or 'file.py:function' with the "
                        "signature compute_score(data_source, solution_str, ground_truth, extra_info=None)")]
    return []


def reward(group: str = "reward", name: str = "reward", score_column: str = "token_level_scores",
           **changes: Any) -> OpSpec:
    """Score each sample with a rule-based function (verl's compute_score signature), concurrently.

    Outputs ``score_column`` (default ``token_level_scores``, what the advantage reads), then
    ``<name>_extra`` (the function's extra values, and ``reward_error`` for failed samples) and
    ``<name>_metrics``. Give another `name` and `score_column` for one source of a mixed reward
    (see `combine_rewards`). A group of several ranks is a pool of reward workers: calls go to the
    least-loaded idle rank (``load/<name>/rank_<r>/rows`` in the metrics)."""
    return OpSpec(
        name=name,
        inputs=_cols("prompts", "responses", "response_mask", "data_source", "ground_truth", "extra_info"),
        outputs={score_column: COLUMNS["token_level_scores"] if score_column == "token_level_scores"
                 else T.float32(R, doc=f"score of the {name} op, on the last response token"),
                 f"{name}_extra": T.json(doc="extra values returned by the reward function; reward_error on failure"),
                 f"{name}_metrics": T.json().metric()},
        granularity="sample",
        group=group,
        params={
            "tokenizer": Param(str, "", "tokenizer directory for decoding responses (default: data.tokenizer, "
                               "then actor.model_path, then the built-in character tokenizer)"),
            "fn": Param(str, "rlgraph.ops.reward.functions:compute_score",
                        "'module:function' or 'file.py:function' with signature compute_score(data_source, "
                        "solution_str, ground_truth, extra_info=None) -> float | dict; may be async def"),
            "micro_batch_size": Param(int, 64, "samples per call (a call goes to one reward worker)", minimum=1),
            "executor": Param(str, "thread", "how a worker scores a call's samples concurrently: thread (I/O-bound "
                              "functions) or process (CPU-heavy; a timed-out sample's process is killed); "
                              "async def functions always run on an event loop", choices=EXECUTORS),
            "concurrency": Param(int, 8, "samples scored at once per worker", minimum=1),
            "timeout_s": Param(float, 60.0, "time limit per sample, from its start (0: none)", minimum=0.0),
            "on_error": Param(str, "fail", "a sample whose function raised or timed out: fail the step, score it "
                              "zero, or drop its group from training (drop_group)", choices=ON_ERROR),
        },
        impl="rlgraph.ops.reward.rule:RewardWorker.compute_reward",
        batching=Batching(micro_batch="micro_batch_size"),
        drops=True,  # on_error=drop_group
        validate=_validate_reward,
        cost=0.5,
    ).with_(**changes)


def reward_model(group: str = "reward_model", name: str = "reward_model", score_column: str = "rm_scores",
                 **changes: Any) -> OpSpec:
    """Score each sample with a discriminative reward model (a sequence-classification head).

    Place it on its own group/pool, or on the policy's group (``group="actor"``) to share its
    devices: then the model sleeps on the CPU between calls (``offload``). Combine its scores
    with rule scores through `combine_rewards`, or name ``score_column="token_level_scores"``
    to use it alone."""
    return OpSpec(
        name=name,
        inputs=_cols(*_MODEL_INPUTS, "response_mask"),
        outputs={score_column: COLUMNS["token_level_scores"] if score_column == "token_level_scores"
                 else T.float32(R, doc=f"reward-model score of the {name} op, on the last response token")},
        granularity="sample",
        group=group,
        params={
            "model_path": Param(str, "", "directory of a Hugging Face sequence-classification model (num_labels=1) "
                                "with its tokenizer", setup=True),
            "micro_batch_size": Param(int, 32, "samples per forward pass", minimum=1),
            "offload": Param(bool, True, "on a GPU, keep the model on the CPU between calls (wake, score, sleep)",
                             setup=True),
            "dtype": Param(str, "float32", "weights' dtype", choices=("float32", "bfloat16", "float16"), setup=True),
            "check_tokenizer": Param(bool, True, "refuse a reward model whose tokenizer maps the policy's tokens to "
                                     "other ids (it reads the policy's token ids directly)", setup=True),
        },
        config_key="reward_model",  # the worker class reads its settings there, whatever the op's name
        impl="rlgraph.ops.reward.model:RewardModelWorker.compute_rm_score",
        batching=Batching(micro_batch="micro_batch_size"),
        cost=1.0,
        doc="Reward-model forward pass: one scalar per sample on its last response token.",
    ).with_(**changes)


def combine_rewards(weights: Mapping[str, float], group: str = "reward", name: str = "combine_rewards",
                    **changes: Any) -> OpSpec:
    """Weighted sum of several score columns into ``token_level_scores``: e.g. ``{"rule_scores": 1.0,
    "rm_scores": 0.5}``. Each weight is a param (``combine_rewards.w_<column>``); each source's mean
    over real samples is kept as a metric (``combine_rewards/<column>/mean``)."""
    if not weights:
        raise DeclarationError("combine_rewards needs at least one score column with a weight")
    return OpSpec(
        name=name,
        inputs={**{col: T.float32(R) for col in weights}, **_cols("response_mask")},
        outputs={**_cols("token_level_scores"), f"{name}_metrics": T.json().metric()},
        granularity="sample",
        group=group,
        params={f"w_{col}": Param(float, float(w), f"weight of {col!r} in the combined score")
                for col, w in weights.items()},
        impl="rlgraph.ops.reward.rule:combine_rewards",
        cost=0.1,
        doc="Mixed reward: a weighted sum of rule and model scores.",
    ).with_(**changes)


def overlong_penalty(score_column: str = "rule_scores", group: str = "reward", name: str = "overlong",
                     output_column: str = "token_level_scores", **changes: Any) -> OpSpec:
    """DAPO's soft overlong punishment: a response longer than ``max_response_length -
    buffer_len`` tokens loses ``penalty_factor`` times the fraction of the buffer it ran into,
    added to ``score_column`` on its last token; the result is ``output_column``
    (``token_level_scores``, what the advantage reads; another name to feed `filter_groups`). Give
    the reward op ``score_column=score_column`` so that this op sits between it and the advantage."""
    out = (COLUMNS["token_level_scores"] if output_column == "token_level_scores"
           else T.float32(R, doc=f"the score after the {name} op's overlong penalty"))
    return OpSpec(
        name=name,
        inputs={score_column: T.float32(R), **_cols("response_mask")},
        outputs={output_column: out, f"{name}_metrics": T.json().metric()},
        granularity="sample",
        group=group,
        params={
            "score_column": Param(str, score_column, "the score column the penalty is added to (set by the "
                                  "declaration)", choices=(score_column,)),
            "buffer_len": Param(int, 4, "overlong buffer: the last this many tokens before the maximum length are "
                                "penalised linearly (DAPO's overlong_buffer.len)", minimum=1),
            "penalty_factor": Param(float, 1.0, "penalty at the maximum length (DAPO's overlong_buffer."
                                    "penalty_factor)", minimum=0.0),
            "max_response_length": Param(int, 0, "the maximum response length the buffer ends at (0: "
                                         "rollout.max_new_tokens)", minimum=0),
        },
        impl="rlgraph.ops.reward.rule:overlong_penalty",
        cost=0.05,
        doc="Soft overlong punishment (DAPO): a linear penalty in the last buffer_len tokens.",
    ).with_(**changes)


def filter_groups(score_column: str = "raw_scores", metric_column: str | None = None, group: str = "reward",
                  name: str = "filter_groups", **changes: Any) -> OpSpec:
    """DAPO's dynamic-sampling filter (verl's ``algorithm.filter_groups``): drops from training every
    group whose metric has zero variance (all its samples scored alike, so a group-relative
    advantage is zero for all of them), and passes ``score_column`` on as ``token_level_scores``.

    The metric is a token-level column summed per sample: ``score_column`` by default, or
    `metric_column` (say the rule score before overlong shaping). Give the op that writes the
    score ``score_column=score_column`` so that this op sits between it and the advantage. A
    group of one sample is kept (its variance says nothing), as verl keeps it. Dropped groups are
    counted under ``samples/dropped/zero_variance``.

    Each step then refills its batch, as verl's ``filter_groups`` does: the data source gives fresh
    prompts for another round of generation and scoring (the ops up to this one) until the kept
    groups fill ``data.batch_size`` prompts, for at most ``max_rounds`` rounds. Only the first
    ``data.batch_size`` kept groups are trained (the rest count as ``samples/dropped/surplus``),
    padded to the plan's multiple as any batch. When the rounds run out, ``on_exhaust`` says
    whether the step trains on the groups it has or fails."""
    metric = metric_column or score_column
    inputs: dict[str, ColumnType] = {score_column: T.float32(R), "uid": SYSTEM_COLUMNS["uid"]}
    if metric != score_column:
        inputs[metric] = T.float32(R)
    return OpSpec(
        name=name,
        inputs=inputs,
        outputs={**_cols("token_level_scores"), f"{name}_metrics": T.json().metric()},
        granularity="group",
        group=group,
        params={
            "score_column": Param(str, score_column, "the score column passed on as token_level_scores (set by the "
                                  "declaration)", choices=(score_column,)),
            "metric_column": Param(str, metric, "the column whose per-sample sum must vary within a group (set by "
                                   "the declaration: filter_groups(metric_column=...))", choices=(metric,)),
            "min_std": Param(float, 0.0, "a group whose metric has a standard deviation at most this is dropped "
                             "(0: only groups whose samples all scored the same)", minimum=0.0),
            "micro_batch_size": Param(int, 16, "groups per call", minimum=1),
            "max_rounds": Param(int, 4, "generation rounds per step at most, the first included (verl's "
                                "max_num_gen_batches): each round scores fresh prompts until the kept groups fill "
                                "data.batch_size; 1: no refill, the step trains on what its one round kept",
                                minimum=1),
            "on_exhaust": Param(str, "train", "when max_rounds rounds kept fewer than data.batch_size groups: train "
                                "on the groups kept (train) or stop the run with an error (fail, as verl)",
                                choices=("train", "fail")),
        },
        impl="rlgraph.ops.reward.rule:filter_groups",
        batching=Batching(micro_batch="micro_batch_size"),
        drops=True,
        refill=True,
        cost=0.05,
        doc="Dynamic sampling's filter (DAPO): drops the groups whose metric has zero variance.",
    ).with_(**changes)


def _forward(name: str, output: tuple[str, ...], group: str, impl: str, state: str | None, doc: str) -> OpSpec:
    inputs = _cols(*_MODEL_INPUTS, "response_mask")
    if state:
        inputs[state] = COLUMNS[state]
    return OpSpec(
        name=name,
        inputs=inputs,
        outputs=_cols(*output),
        granularity="sample",
        group=group,
        params={"micro_batch_size": Param(int, 16, "samples per forward pass on a rank", minimum=1)},
        impl=impl,
        batching=Batching(micro_batch="micro_batch_size"),
        cost=1.0,
        doc=doc,
    )


def old_logprob(group: str = "actor", **changes: Any) -> OpSpec:
    """Log-probs (and entropy) of the responses under the current policy, compared with the rollout
    engine's (``rollout_probs_diff`` metrics: how far the engine's distribution is from the trainer's)."""
    spec = _forward("old_logprob", ("old_log_probs", "entropy", "old_logprob_metrics"), group,
                    "rlgraph.ops.train.actor:ActorWorker.compute_log_prob", "policy_weights",
                    "Forward pass of the actor on response tokens.")
    return spec.with_(
        inputs={**spec.inputs, **_cols("rollout_log_probs")},
        optional_inputs={"rollout_log_probs"},
        params={**spec.params, "compare_rollout": Param(
            bool, True, "compare with the rollout engine's log-probs of the same tokens (rollout_probs_diff_mean/max "
            "metrics); makes generate return them")},
        uses=lambda params: {"rollout_log_probs"} if params.get("compare_rollout") else set(),
    ).with_(**changes)


def ref(group: str = "actor", **changes: Any) -> OpSpec:
    """Log-probs of the responses under the frozen reference policy."""
    spec = _forward("ref", ("ref_log_prob",), group, "rlgraph.ops.train.actor:ActorWorker.compute_ref_log_prob",
                    None, "Forward pass of the frozen reference model.")
    params = {**spec.params, "model_path": Param(str, "", "reference model directory (default: actor.model_path)")}
    return spec.with_(params=params, **changes)


def values(group: str = "critic", **changes: Any) -> OpSpec:
    """Critic values per response token."""
    return _forward("values", ("values",), group, "rlgraph.ops.train.critic:CriticWorker.compute_values",
                    "critic_weights", "Forward pass of the critic (value head).").with_(**changes)


def _validate_advantage(granularity: str):
    def validate(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
        out: list[Problem] = []
        est = params.get("estimator")
        if est in ESTIMATOR_NEEDS:
            need, needs_values = ESTIMATOR_NEEDS[est]
            if need == "batch" and granularity != "batch":
                out.append(Problem(
                    "op-config", f"algorithm.estimator={est!r} whitens over the whole batch, but the advantage "
                    f"op runs per {granularity}",
                    f"declare it with rlgraph.ops.stages.advantage({est!r}), which makes it a barrier"))
            if needs_values and "values" not in connected:
                out.append(Problem(
                    "op-config", f"algorithm.estimator={est!r} needs critic values, but no op produces 'values'",
                    "add stages.values() and stages.update_critic() (a critic), or use a critic-free "
                    "estimator such as algorithm.estimator=grpo", column="values"))
        if params.get("use_kl_in_reward"):
            for col in ("old_log_probs", "ref_log_prob"):
                if col not in connected:
                    out.append(Problem(
                        "op-config", f"algorithm.use_kl_in_reward=true needs column {col!r}, which no op produces",
                        "add stages.ref() and stages.old_logprob(), or set algorithm.use_kl_in_reward=false",
                        column=col))
        return out

    return validate


def _advantage_uses(params: Mapping[str, Any]) -> set[str]:
    used = {"values"} if ESTIMATOR_NEEDS.get(params.get("estimator"), ("", False))[1] else set()
    if params.get("use_kl_in_reward"):
        used |= {"old_log_probs", "ref_log_prob"}
    return used


def advantage(estimator: str = "gae", group: str = "advantage", **changes: Any) -> OpSpec:
    """Advantages and returns: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline); KL in reward."""
    if estimator not in ESTIMATORS:
        raise DeclarationError(f"unknown advantage estimator {estimator!r}; use one of {', '.join(ESTIMATORS)}")
    granularity = ESTIMATOR_NEEDS[estimator][0]
    return OpSpec(
        name="advantage",
        inputs={**_cols("token_level_scores", "response_mask"), **SYSTEM_COLUMNS,
                **_cols("values", "old_log_probs", "ref_log_prob")},
        outputs=_cols("advantages", "returns", "token_level_rewards", "advantage_metrics"),
        granularity=granularity,  # type: ignore[arg-type]
        group=group,
        config_key="algorithm",
        optional_inputs={"values", "old_log_probs", "ref_log_prob"},
        params={
            "estimator": Param(str, estimator, "advantage estimator", choices=ESTIMATORS),
            "gamma": Param(float, 1.0, "discount factor", minimum=0.0),
            "lam": Param(float, 1.0, "GAE lambda", minimum=0.0),
            "norm_adv_by_std": Param(bool, True, "GRPO: divide by the group std (false: Dr.GRPO)"),
            "use_kl_in_reward": Param(bool, False, "subtract kl_coef * KL(policy || ref) from token rewards"),
            "kl_penalty": Param(str, "kl", "KL estimator for the reward penalty", choices=KL_KINDS),
            "kl_coef": Param(float, 0.001, "initial KL coefficient", minimum=0.0),
            "kl_ctrl": Param(str, "fixed", "fixed or adaptive KL coefficient", choices=("fixed", "adaptive")),
            "kl_target": Param(float, 0.1, "adaptive controller's KL target", minimum=0.0),
            "kl_horizon": Param(int, 10000, "adaptive controller's horizon", minimum=1),
        },
        impl="rlgraph.ops.algos.advantage_op:AdvantageWorker.compute_advantage",
        validate=_validate_advantage(granularity),
        uses=_advantage_uses,
        cost=0.2,
        doc="Advantage estimation; a barrier for whitening estimators, per group for GRPO/RLOO.",
    ).with_(**changes)


def _update_params(lr: float, extra: Mapping[str, Param]) -> dict[str, Param]:
    return {
        "model_path": Param(str, "", "local Hugging Face model directory (the critic defaults to actor.model_path)",
                            setup=True),
        "lr": Param(float, lr, "learning rate", minimum=0.0),
        "mini_batch_size": Param(int, 4, "prompts per mini-batch (x n samples)", minimum=1),
        "micro_batch_size": Param(int, 8, "samples per micro-batch on a rank (gradient accumulation)", minimum=1),
        "ppo_epochs": Param(int, 1, "passes over the batch per step", minimum=1),
        "grad_clip": Param(float, 1.0, "max global gradient norm (0: off)", minimum=0.0),
        "weight_decay": Param(float, 0.0, "AdamW weight decay", minimum=0.0),
        "lr_warmup_steps": Param(int, 0, "linear LR warm-up, in optimizer steps", minimum=0),
        "loss_agg_mode": Param(str, "token-mean", "how token losses are aggregated", choices=AGG_MODES),
        "backend": Param(str, "torch", "torch (DDP over gloo/nccl) or deepspeed", choices=ENGINE_BACKENDS),
        "zero_stage": Param(int, 0, "DeepSpeed ZeRO stage (backend=deepspeed)", choices=(0, 1, 2, 3)),
        **extra,
    }


def update_critic(group: str = "critic", **changes: Any) -> OpSpec:
    """Clipped value-loss update of the critic over mini-batches and epochs."""
    return OpSpec(
        name="update_critic",
        inputs=_cols(*_MODEL_INPUTS, "response_mask", "values", "returns"),
        outputs=_cols("critic_metrics", "critic_weights"),
        granularity="batch",
        group=group,
        config_key="critic",
        params=_update_params(1e-5, {
            "cliprange_value": Param(float, 0.5, "value clip range around the old values", minimum=0.0),
        }),
        impl="rlgraph.ops.train.critic:CriticWorker.update_critic",
        batching=Batching(mini_batch="mini_batch_size", micro_batch="micro_batch_size", epochs="ppo_epochs"),
        cost=3.0,
    ).with_(**changes)


def _validate_actor(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    out = []
    if params.get("use_kl_loss") and "ref_log_prob" not in connected:
        out.append(Problem("op-config", "actor.use_kl_loss=true needs column 'ref_log_prob', which no op produces",
                           "add stages.ref() to the pipeline, or set actor.use_kl_loss=false", column="ref_log_prob"))
    for key in ("tis_cap", "decoupled_cap"):
        if params.get(key) and "rollout_log_probs" not in connected:
            out.append(Problem("op-config", f"actor.{key} > 0 needs column 'rollout_log_probs', which no op produces",
                               f"generate with stages.generate(), or set actor.{key}=0", column="rollout_log_probs"))
    if params.get("tis_cap") and params.get("decoupled_cap"):
        out.append(Problem("op-config", "actor.tis_cap and actor.decoupled_cap are both set; they are two "
                           "corrections of the same mismatch (truncated importance sampling, decoupled PPO)",
                           "choose one: set actor.tis_cap=0 or actor.decoupled_cap=0"))
    dc = params.get("decoupled_cap")
    if dc and dc <= 1.0:
        out.append(Problem("op-config", f"actor.decoupled_cap={dc} would drop every token whose behaviour weight "
                           "is above it, including on-policy ones (weight 1)", "set actor.decoupled_cap > 1 "
                           "(AReaL uses 5), or 0 for off"))
    return out


def _actor_uses(params: Mapping[str, Any]) -> set[str]:
    # staleness metrics, and the guard against training on too old samples
    used = {"policy_version", "policy_version_end"}
    if params.get("use_kl_loss"):
        used.add("ref_log_prob")
    if params.get("tis_cap") or params.get("decoupled_cap"):
        used.add("rollout_log_probs")
    return used


def update_actor(group: str = "actor", **changes: Any) -> OpSpec:
    """PPO clipped policy update (dual clip, KL loss, entropy bonus); skipped during critic warm-up."""
    return OpSpec(
        name="update_actor",
        inputs=_cols(*_MODEL_INPUTS, "response_mask", "old_log_probs", "advantages", "ref_log_prob",
                     "rollout_log_probs", "policy_version", "policy_version_end"),
        outputs=_cols("actor_metrics", "policy_weights"),
        granularity="batch",
        group=group,
        config_key="actor",
        optional_inputs={"ref_log_prob", "rollout_log_probs", "policy_version", "policy_version_end"},
        params=_update_params(1e-6, {
            "clip_ratio_low": Param(float, 0.2, "PPO clip below 1 (eps_low)", minimum=0.0),
            "clip_ratio_high": Param(float, 0.2, "PPO clip above 1 (eps_high)", minimum=0.0),
            "clip_ratio_c": Param(float, 3.0, "dual-clip bound for negative advantages", minimum=1.0),
            "loss_mode": Param(str, "vanilla", "policy loss: vanilla (PPO clip, dual clip, per token) or gspo "
                               "(one ratio per sequence, the geometric mean of its token ratios, clipped per "
                               "sequence, aggregated seq-mean-token-mean; use clip ratios like 3e-4 / 4e-4)",
                               choices=LOSS_MODES),
            "entropy_coeff": Param(float, 0.0, "entropy bonus coefficient", minimum=0.0),
            "use_kl_loss": Param(bool, False, "add kl_loss_coef * KL(policy || ref) to the loss (GRPO style)"),
            "kl_loss_coef": Param(float, 0.001, "KL loss coefficient", minimum=0.0),
            "kl_loss_type": Param(str, "low_var_kl", "KL estimator for the loss", choices=KL_KINDS),
            "tis_cap": Param(float, 0.0, "truncated importance sampling against the rollout engine: weight each "
                             "token's policy loss by min(exp(old_log_probs - rollout_log_probs), tis_cap); 0: off",
                             minimum=0.0),
            "decoupled_cap": Param(float, 0.0, "decoupled PPO (AReaL) for off-policy samples: clip the ratio against "
                                   "old_log_probs (the proximal policy, recomputed by the current one) and weight "
                                   "each token by exp(old_log_probs - rollout_log_probs), dropping tokens whose "
                                   "weight exceeds this cap (> 1; AReaL uses 5); 0: off", minimum=0.0),
        }),
        impl="rlgraph.ops.train.actor:ActorWorker.update_actor",
        batching=Batching(mini_batch="mini_batch_size", micro_batch="micro_batch_size", epochs="ppo_epochs"),
        skip_before="trainer.critic_warmup",
        validate=_validate_actor,
        uses=_actor_uses,
        cost=3.0,
    ).with_(**changes)
