"""Built-in declarations of the PPO/GRPO stages (BRIEF section 1): columns, granularity, params.

These are declarations only: each returns an `OpSpec` (or the `DataSource`) whose body is
referenced by import path and loaded by the runtime. Call them with another ``group=`` to
place a stage elsewhere, or ``.with_(...)`` the result to change anything else.

Column names follow verl's, so reward code and metrics carry over.
"""

from __future__ import annotations

import difflib
import re

from types import MappingProxyType
from typing import Any, Mapping

from rlgraph.errors import DeclarationError, Problem
from rlgraph.graph.columns import ANY_DIM, ColumnType, T
from rlgraph.graph.config import Param
from rlgraph.graph.dsl import SYSTEM_COLUMNS, Batching, DataSource, OpSpec
from rlgraph.graph.settings import params_of
from rlgraph.ops.names import ESTIMATOR_NEEDS, ESTIMATORS, parse_token_ids
from rlgraph.ops.settings import (ActorSettings, AgentSettings, AlgorithmSettings, CriticSettings, DataSettings,
                                  FilterGroupsSettings, ForwardSettings, JudgeSettings, OldLogprobSettings,
                                  OverlongSettings, RefSettings, RewardModelSettings, RewardSettings, RolloutSettings,
                                  TeacherSettings, ValuesSettings)

__all__ = [
    "COLUMNS",
    "SUMMARIES",
    "VALIDATION",
    "prompt_source",
    "generate",
    "agent_rollout",
    "env_reward",
    "reward",
    "filter_groups",
    "reward_model",
    "combine_rewards",
    "overlong_penalty",
    "old_logprob",
    "ref",
    "teacher_logprob",
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
    # agent_rollout (besides generate's columns)
    "turn_ids": T.int64(R, doc="the turn of each response token: a model turn and the observation after it share it"),
    "env_rewards": T.float32(doc="the environment's rewards of the trajectory, summed"),
    # reward
    "token_level_scores": T.float32(R, doc="the score, placed on the last response token"),
    "reward_extra": T.json(doc="extra values returned by the reward function"),
    # forward passes
    "old_log_probs": T.float32(R, doc="log-probs of responses under the current policy"),
    "entropy": T.float32(R, doc="per-token entropy of the current policy"),
    "ref_log_prob": T.float32(R, doc="log-probs of responses under the frozen reference"),
    "teacher_log_probs": T.float32(R, doc="log-probs of the responses' tokens under the distillation teacher"),
    "teacher_topk_ids": T.int64(R, ANY_DIM, doc="the teacher's teacher.top_k most likely next tokens at each "
                                "response position"),
    "teacher_topk_log_probs": T.float32(R, ANY_DIM, doc="their log-probs under the teacher (normalised over the "
                                        "whole vocabulary)"),
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
    "critic_weights": T.opaque(doc="critic parameters after the update").state(replicated=True),
    "policy_weights": T.opaque(doc="policy parameters after the update").state(replicated=True),
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
        params={**params_of(DataSettings), **params},
        impl="rlgraph.ops.data.prompts:PromptSource",
    )


def _validate_generate(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    try:
        parse_token_ids(params["stop_token_ids"])
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
        config_key=RolloutSettings.namespace,
        params=params_of(RolloutSettings),
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


def _validate_agent(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    """Import the agent's environment, tools and tool format at compile time: a wrong reference
    fails `rlgraph validate`, not the first step."""
    from rlgraph.ops.agents.rollout import load_kit
    from rlgraph.ops.refs import RefError

    try:
        load_kit(str(params["env"]), str(params["tools"]), str(params["tool_format"]))
    except RefError as e:
        return [Problem("op-config", str(e), "point rollout.env at 'module:Class' (an Environment) or rollout.tools "
                        "at 'module:function,...'; rollout.tool_format is hermes, inline or 'module:Class'")]
    return _validate_generate(params, connected)


def agent_rollout(env: str = "", tools: str = "", tool_format: str = "hermes", group: str = "actor", name: str = "agent",
                  **changes: Any) -> OpSpec:
    """Multi-turn rollouts: per trajectory, model turn -> tool calls or the environment's step ->
    observation appended -> next turn, until the answer, rollout.max_turns or the token budget.
    Token-exact (the sampled ids as generated, each observation tokenised on its own), with
    ``response_mask`` 0 on observation tokens and the turn of every token in ``turn_ids``. One
    call per rank; each group is handed on when its last trajectory ends. Its settings live in
    ``rollout.*`` (it replaces `generate`); its metrics are ``<name>/*`` (default ``agent/*``).

    `env`, `tools`, `tool_format` are the defaults of ``rollout.env``, ``rollout.tools`` and
    ``rollout.tool_format``: references such as ``"my_envs.py:GuessNumber"`` (see docs/agents.md)."""
    return OpSpec(
        name=name,
        inputs=_cols("prompt_ids", "policy_weights", "data_source", "ground_truth", "extra_info"),
        outputs=_cols("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                      "rollout_log_probs", "rollout_metrics", "policy_version", "policy_version_end", "turn_ids",
                      "env_rewards"),
        granularity="group",
        group=group,
        config_key=RolloutSettings.namespace,
        params={**params_of(RolloutSettings), **params_of(AgentSettings, env=env, tools=tools, tool_format=tool_format)},
        impl="rlgraph.ops.train.actor:ActorWorker.agent_rollout",
        group_size_param="n",
        batching=Batching(per_rank=True),
        streams=True,
        stale_ok=True,
        validate=_validate_agent,
        cost=5.0,
        doc="Run each prompt's n trajectories over several turns with tools or an environment, streaming each "
            "finished group; weights are synced from update_actor once per step.",
    ).with_(**changes)


def env_reward(group: str = "reward", name: str = "env_reward", **changes: Any) -> OpSpec:
    """The environment's summed reward of each trajectory as its score (``token_level_scores``, on
    the last response token), for pipelines whose environment scores the trajectories."""
    return OpSpec(
        name=name,
        inputs=_cols("env_rewards", "response_mask"),
        outputs=_cols("token_level_scores"),
        group=group,
        impl="rlgraph.ops.reward.rule:env_reward",
        cost=0.1,
        doc="Place each trajectory's environment reward on its last response token.",
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


def _drops_on_error(params: Mapping[str, Any]) -> bool:
    """A scoring op drops rows only with ``on_error=drop_group``: fail and zero keep every row."""
    return params.get("on_error") == "drop_group"


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
        # what verl's compute_score is given (the decoded response, its data source, ground truth and extra
        # info), and the response mask: read, it makes a per-group op after the reward (the advantage)
        # ready when the reward's call starts, so that op runs inside it (rlgraph.graph.fuse)
        inputs=_cols("responses", "response_mask", "data_source", "ground_truth", "extra_info"),
        outputs={score_column: COLUMNS["token_level_scores"] if score_column == "token_level_scores"
                 else T.float32(R, doc=f"score of the {name} op, on the last response token"),
                 f"{name}_extra": T.json(doc="extra values returned by the reward function; reward_error on failure"),
                 f"{name}_metrics": T.json().metric()},
        granularity="sample",
        group=group,
        params=params_of(RewardSettings),
        impl="rlgraph.ops.reward.rule:RewardWorker.compute_reward",
        batching=Batching(micro_batch="micro_batch_size"),
        drops=True,  # on_error=drop_group
        drops_if=_drops_on_error,
        validate=_validate_reward,
        cost=0.5,
        # each sample is scored alone: a call of several micro-batches (ready chunks batched, or the op
        # fused into the policy's call) decodes and scores them at once, with a metrics record per chunk
        vectorised=True,
        # the body decodes each response as it is and writes its score into rows of the same lengths: it
        # takes the responses (and the mask it reads only for fusion) as their rows. A body of one's own
        # (impl=, here or through with_) gets them padded, as any op, unless it names as_rows itself
        # (`OpSpec.with_`), and inputs given here keep only the names they still hold
        as_rows=("responses", "response_mask"),
    ).with_(**changes)


def _score_type(score_column: str, doc: str) -> ColumnType:
    """A score column's type: the pipeline's own `token_level_scores`, or a float column of its own."""
    return COLUMNS["token_level_scores"] if score_column == "token_level_scores" else T.float32(R, doc=doc)


def reward_model(group: str = "reward_model", name: str = "reward_model", score_column: str = "rm_scores",
                 kind: str = "discriminative", **changes: Any) -> OpSpec:
    """Score each sample with a discriminative reward model (a sequence-classification head), or with
    ``kind="generative"`` a judge: a served model asked to grade each response (``judge.*``).

    Place it on its own group/pool, or on the policy's group (``group="actor"``) to share its
    devices: then the model sleeps on the CPU between calls (``offload``). Combine its scores
    with rule scores through `combine_rewards`, or name ``score_column="token_level_scores"``
    to use it alone."""
    if kind not in ("discriminative", "generative"):
        raise DeclarationError(f"reward_model(kind={kind!r}): use 'discriminative' (a reward-model head) or "
                               f"'generative' (a judge model's graded answer)")
    if kind == "generative":
        return OpSpec(
            name=name,
            inputs=_cols("prompts", "responses", "response_mask", "ground_truth"),
            outputs={score_column: _score_type(score_column, f"judge's score of the {name} op, on the last "
                                                                 "response token"),
                     f"{name}_metrics": T.json().metric()},
            granularity="sample",
            group=group,
            params=params_of(JudgeSettings),
            config_key=JudgeSettings.namespace,
            impl="rlgraph.ops.reward.judge:JudgeWorker.compute_judge_score",
            batching=Batching(micro_batch="micro_batch_size"),
            drops=True,
            drops_if=_drops_on_error,
            validate=_validate_judge,
            cost=2.0,
            doc="A judge model grades each response (generative reward model); its parsed score on the last token.",
        ).with_(**changes)
    return OpSpec(
        name=name,
        inputs=_cols(*_MODEL_INPUTS, "response_mask"),
        outputs={score_column: _score_type(score_column, f"reward-model score of the {name} op, on the last "
                                                         "response token")},
        granularity="sample",
        group=group,
        params=params_of(RewardModelSettings),
        config_key=RewardModelSettings.namespace,  # the worker class reads its settings there, whatever the op's name
        impl="rlgraph.ops.reward.model:RewardModelWorker.compute_rm_score",
        batching=Batching(micro_batch="micro_batch_size"),
        cost=1.0,
        doc="Reward-model forward pass: one scalar per sample on its last response token.",
    ).with_(**changes)


def _validate_judge(params: Mapping[str, Any], connected: frozenset[str]) -> list[Problem]:
    out = []
    if params.get("backend") == "vllm" and not params.get("model_path"):
        out.append(Problem("op-config", "judge.backend=vllm needs judge.model_path", "set judge.model_path to a local "
                           "Hugging Face causal LM, or judge.backend=openai with judge.url"))
    if params.get("backend") == "openai" and not (params.get("url") and params.get("model")):
        out.append(Problem("op-config", "judge.backend=openai needs judge.url and judge.model",
                           "set judge.url=http://HOST:PORT/v1 and judge.model=<served model name>"))
    pattern = params.get("score_pattern") or ""
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        out.append(Problem("op-config", f"judge.score_pattern={pattern!r} is not a regular expression: {e}",
                           "write a Python regular expression with one group around the number"))
    else:
        if groups < 1:
            out.append(Problem("op-config", f"judge.score_pattern={pattern!r} has no group",
                               "put the number in a group, e.g. Score:\\s*(\\d+)"))
    unknown = sorted(set(re.findall(r"{(\w*)}", params.get("template") or "")) - {"prompt", "response", "ground_truth"})
    if unknown:
        out.append(Problem("op-config", f"judge.template names {unknown}, which a sample does not have",
                           "use {prompt}, {response} and {ground_truth} (double a brace to write it: {{ }})"))
    return out


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
        params=params_of(OverlongSettings, score_column=score_column),
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
        params=params_of(FilterGroupsSettings, score_column=score_column, metric_column=metric),
        impl="rlgraph.ops.reward.rule:filter_groups",
        batching=Batching(micro_batch="micro_batch_size"),
        drops=True,
        refill=True,
        cost=0.05,
        doc="Dynamic sampling's filter (DAPO): drops the groups whose metric has zero variance.",
    ).with_(**changes)


def _forward(settings: type[ForwardSettings], output: tuple[str, ...], group: str, impl: str, state: str | None,
             doc: str) -> OpSpec:
    inputs = _cols(*_MODEL_INPUTS, "response_mask")
    if state:
        inputs[state] = COLUMNS[state]
    return OpSpec(
        name=settings.namespace,
        inputs=inputs,
        outputs=_cols(*output),
        granularity="sample",
        group=group,
        params=params_of(settings),
        impl=impl,
        batching=Batching(micro_batch="micro_batch_size"),
        cost=1.0,
        doc=doc,
    )


def old_logprob(group: str = "actor", **changes: Any) -> OpSpec:
    """Log-probs (and entropy) of the responses under the current policy, compared with the rollout
    engine's (``rollout_probs_diff`` metrics: how far the engine's distribution is from the trainer's)."""
    spec = _forward(OldLogprobSettings, ("old_log_probs", "entropy", "old_logprob_metrics"), group,
                    "rlgraph.ops.train.actor:ActorWorker.compute_log_prob", "policy_weights",
                    "Forward pass of the actor on response tokens.")
    return spec.with_(
        inputs={**spec.inputs, **_cols("rollout_log_probs")},
        optional_inputs={"rollout_log_probs"},
        uses=lambda params: {"rollout_log_probs"} if params["compare_rollout"] else set(),
    ).with_(**changes)


def ref(group: str = "actor", **changes: Any) -> OpSpec:
    """Log-probs of the responses under the frozen reference policy."""
    return _forward(RefSettings, ("ref_log_prob",), group, "rlgraph.ops.train.actor:ActorWorker.compute_ref_log_prob",
                    None, "Forward pass of the frozen reference model.").with_(**changes)


def teacher_logprob(group: str = "teacher", **changes: Any) -> OpSpec:
    """Log-probs of the student's sampled tokens under a teacher (on-policy distillation): a transformers
    forward on its own worker group (or the actor's, colocated), or a vLLM engine's prompt log-probs.
    Streams per finished group, as ``ref`` does. The teacher must share the student's tokenizer."""
    return _forward(TeacherSettings, ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs"), group,
                    "rlgraph.ops.train.teacher:TeacherWorker.compute_teacher_log_prob", None,
                    "Forward pass of the distillation teacher on the student's responses.").with_(
        validate=_validate_teacher).with_(**changes)


def _validate_teacher(params: Mapping[str, Any], connected: frozenset[str],
                      config: Mapping[str, Any] | None = None) -> list[Problem]:
    out = []
    if not params.get("model_path"):
        out.append(Problem("op-config", "teacher_logprob has no teacher: teacher.model_path is empty",
                           "set teacher.model_path to a local Hugging Face model directory with the student's "
                           "tokenizer"))
    if params.get("backend") == "vllm" and params.get("temperature") != 1.0:
        out.append(Problem("op-config", f"teacher.backend=vllm scores at temperature 1 only, but "
                           f"teacher.temperature={params.get('temperature')}",
                           "set teacher.temperature=1, or teacher.backend=hf"))
    student = (config or {}).get("actor.model_path") or (config or {}).get("rollout.model_path")
    if params.get("model_path") and student:
        from rlgraph.ops.tokenizers import tokenizer_mismatch

        why = tokenizer_mismatch(str(student), str(params["model_path"]))
        if why:
            out.append(Problem("op-config", f"the teacher (teacher.model_path) and the student (actor.model_path) "
                               f"tokenize differently: {why}; the teacher would score other tokens than the student "
                               f"sampled", "distil from a teacher with the student's tokenizer (same vocabulary and "
                               "special tokens)"))
    return out


def values(group: str = "critic", **changes: Any) -> OpSpec:
    """Critic values per response token."""
    return _forward(ValuesSettings, ("values",), group, "rlgraph.ops.train.critic:CriticWorker.compute_values",
                    "critic_weights", "Forward pass of the critic (value head).").with_(**changes)


def _validate_advantage(granularity: str):
    def validate(params: Mapping[str, Any], connected: frozenset[str],
                 config: Mapping[str, Any] | None = None) -> list[Problem]:
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
        if est == "distill":
            for col, stage in (("teacher_log_probs", "stages.teacher_logprob()"), ("old_log_probs",
                                                                                    "stages.old_logprob()")):
                if col not in connected:
                    out.append(Problem("op-config", f"algorithm.estimator='distill' needs column {col!r}, which no "
                                       f"op produces", f"add {stage} to the pipeline", column=col))
            if (config is not None and not params.get("distill_kl_weight") and not params.get("distill_task_weight")
                    and not config.get("actor.distill_coef")):
                out.append(Problem("op-config", "algorithm.distill_kl_weight=0 and algorithm.distill_task_weight=0 "
                                   "make every advantage 0, and actor.distill_coef=0 adds no distillation loss: the "
                                   "student would learn nothing", "set actor.distill_coef > 0 (with teacher.top_k), "
                                   "or algorithm.distill_kl_weight > 0"))
        elif params.get("distill_task_weight"):
            out.append(Problem("op-config", f"algorithm.distill_task_weight is set, but algorithm.estimator={est!r}",
                               "declare stages.advantage('distill'), or leave algorithm.distill_task_weight at 0"))
        elif params.get("distill_kl_weight") not in (None, 1.0):
            out.append(Problem("op-config", f"algorithm.distill_kl_weight is set, but algorithm.estimator={est!r}",
                               "declare stages.advantage('distill'), or leave algorithm.distill_kl_weight at 1"))
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
    if params.get("estimator") == "distill":
        used |= {"old_log_probs", "teacher_log_probs"}
    if params.get("use_kl_in_reward"):
        used |= {"old_log_probs", "ref_log_prob"}
    return used


def advantage(estimator: str = "gae", group: str = "advantage", **changes: Any) -> OpSpec:
    """Advantages and returns: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline); KL in reward."""
    if estimator not in ESTIMATORS:
        close = ["gae"] if str(estimator).lower() == "ppo" else difflib.get_close_matches(
            str(estimator), list(ESTIMATORS), n=1, cutoff=0.7)
        raise DeclarationError(f"unknown advantage estimator {estimator!r}; use one of {', '.join(ESTIMATORS)}"
                               + (f" (did you mean {close[0]!r}?)" if close else ""))
    granularity = ESTIMATOR_NEEDS[estimator][0]
    return OpSpec(
        name="advantage",
        inputs={**_cols("token_level_scores", "response_mask"), **SYSTEM_COLUMNS,
                **_cols("values", "old_log_probs", "ref_log_prob", "teacher_log_probs")},
        outputs=_cols("advantages", "returns", "token_level_rewards", "advantage_metrics"),
        granularity=granularity,  # type: ignore[arg-type]
        group=group,
        config_key=AlgorithmSettings.namespace,
        optional_inputs={"values", "old_log_probs", "ref_log_prob", "teacher_log_probs"},
        params=params_of(AlgorithmSettings, estimator=estimator),
        impl="rlgraph.ops.algos.advantage_op:AdvantageWorker.compute_advantage",
        validate=_validate_advantage(granularity),
        uses=_advantage_uses,
        # every estimator computes a group from its own rows (a whole-batch one has one chunk per call)
        vectorised=changes.get("granularity", granularity) != "batch",
        cost=0.2,
        doc="Advantage estimation; a barrier for whitening estimators, per group for GRPO/RLOO.",
    ).with_(**changes)


def update_critic(group: str = "critic", **changes: Any) -> OpSpec:
    """Clipped value-loss update of the critic over mini-batches and epochs."""
    return OpSpec(
        name="update_critic",
        inputs=_cols(*_MODEL_INPUTS, "response_mask", "values", "returns"),
        outputs=_cols("critic_metrics", "critic_weights"),
        granularity="batch",
        group=group,
        config_key=CriticSettings.namespace,
        params=params_of(CriticSettings),
        impl="rlgraph.ops.train.critic:CriticWorker.update_critic",
        batching=Batching(mini_batch="mini_batch_size", micro_batch="micro_batch_size", epochs="ppo_epochs"),
        validate=lambda params, connected: _validate_engine("critic", params),
        cost=3.0,
    ).with_(**changes)


def _validate_engine(ns: str, params: Mapping[str, Any]) -> list[Problem]:
    """Engine keys that only one backend reads, set for another: refused, never silently ignored."""
    out = []
    backend = params.get("backend")
    if backend != "fsdp2":
        if params.get("cpu_offload"):
            out.append(Problem("op-config", f"{ns}.cpu_offload=true is an FSDP2 option, but {ns}.backend={backend}",
                               f"set {ns}.backend=fsdp2, or for DeepSpeed use {ns}.zero_stage=3 with ZeRO offload"))
        if params.get("mixed_precision") == "bf16":
            out.append(Problem("op-config", f"{ns}.mixed_precision=bf16 is an FSDP2 option, but {ns}.backend={backend}",
                               f"set {ns}.backend=fsdp2, or {ns}.mixed_precision=auto"))
    if params.get("zero_stage") and backend != "deepspeed":
        out.append(Problem("op-config", f"{ns}.zero_stage={params['zero_stage']} is a DeepSpeed option, but "
                           f"{ns}.backend={backend}", f"set {ns}.backend=deepspeed, or {ns}.zero_stage=0 (fsdp2 "
                           f"shards like ZeRO-3)"))
    return out


def _validate_actor(params: Mapping[str, Any], connected: frozenset[str],
                    config: Mapping[str, Any] | None = None) -> list[Problem]:
    out = _validate_engine("actor", params)
    if params.get("distill_coef"):
        if "teacher_topk_log_probs" not in connected:
            out.append(Problem("op-config", "actor.distill_coef > 0 needs the teacher's top-k distribution "
                               "(teacher_topk_ids, teacher_topk_log_probs), which no op produces",
                               "add stages.teacher_logprob() with teacher.top_k > 0, or set actor.distill_coef=0",
                               column="teacher_topk_log_probs"))
        elif config is not None and not config.get("teacher.top_k"):
            out.append(Problem("op-config", "actor.distill_coef > 0, but teacher.top_k=0: the teacher writes no "
                               "distribution to distil", "set teacher.top_k (e.g. 64; at or above the vocabulary "
                               "size it is the whole distribution), or actor.distill_coef=0"))
    if params.get("lora_rank") and not params.get("lora_alpha"):
        out.append(Problem("op-config", "actor.lora_alpha=0 makes the LoRA adapters add nothing",
                           "set actor.lora_alpha > 0 (commonly 2 x actor.lora_rank)"))
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


def _actor_recomputes(params: Mapping[str, Any]) -> set[str]:
    # old log-probs from the update's first forward (one optimizer step per training step); truncated IS
    # weighs each micro-batch's tokens by that forward's, decoupled PPO too when the forward sees every row
    # (else the update makes the proximal pass itself, in its own call: update_actor)
    return {"old_log_probs"}


def _actor_uses(params: Mapping[str, Any]) -> set[str]:
    # staleness metrics, and the guard against training on too old samples
    used = {"old_log_probs", "policy_version", "policy_version_end"}
    if params.get("use_kl_loss"):
        used.add("ref_log_prob")
    if params.get("tis_cap") or params.get("decoupled_cap"):
        used.add("rollout_log_probs")
    if params.get("distill_coef"):
        used |= {"teacher_topk_ids", "teacher_topk_log_probs"}
    return used


def update_actor(group: str = "actor", **changes: Any) -> OpSpec:
    """PPO clipped policy update (dual clip, KL loss, entropy bonus); skipped during critic warm-up."""
    return OpSpec(
        name="update_actor",
        inputs=_cols(*_MODEL_INPUTS, "response_mask", "old_log_probs", "advantages", "ref_log_prob",
                     "rollout_log_probs", "policy_version", "policy_version_end", "teacher_topk_ids",
                     "teacher_topk_log_probs"),
        outputs=_cols("actor_metrics", "policy_weights"),
        granularity="batch",
        group=group,
        config_key=ActorSettings.namespace,
        optional_inputs={"old_log_probs", "ref_log_prob", "rollout_log_probs", "policy_version", "policy_version_end",
                         "teacher_topk_ids", "teacher_topk_log_probs"},
        params=params_of(ActorSettings),
        impl="rlgraph.ops.train.actor:ActorWorker.update_actor",
        recomputes=_actor_recomputes,
        batching=Batching(mini_batch="mini_batch_size", micro_batch="micro_batch_size", epochs="ppo_epochs"),
        skip_before="trainer.critic_warmup",
        validate=_validate_actor,
        uses=_actor_uses,
        cost=3.0,
    ).with_(**changes)
