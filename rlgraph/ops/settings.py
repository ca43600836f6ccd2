"""The settings of the built-in stages' config sections, as typed models (see `rlgraph.graph.settings`).

One model per section: its fields are the section's keys with their type, default, bounds and doc,
and its ``verl`` table the verl keys that stand for them. `rlgraph.ops.stages` makes each stage's
params from its model (a factory's arguments become defaults: ``advantage("grpo")``), and the
bodies read their section through it: ``RolloutSettings.of(ctx).temperature``. ``combine_rewards``
has no model: its keys (``w_<column>``) are the columns it is declared with.

Torch-free: compiling a pipeline imports this module.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar, Literal, Mapping

from pydantic import Field

from rlgraph.graph.settings import (FIXED, SETUP, ClusterSettings, DataplaneSettings, Section, SourceSettings,
                                    TrainerSettings, verl_aliases)
from rlgraph.ops.names import AGG_MODES, ENGINE_BACKENDS, ESTIMATORS, EXECUTORS, KL_KINDS, LOSS_MODES, ON_ERROR

__all__ = [
    "DataSettings",
    "RolloutSettings",
    "AgentSettings",
    "RewardSettings",
    "RewardModelSettings",
    "JudgeSettings",
    "OverlongSettings",
    "FilterGroupsSettings",
    "ForwardSettings",
    "OldLogprobSettings",
    "RefSettings",
    "TeacherSettings",
    "ValuesSettings",
    "AlgorithmSettings",
    "UpdateSettings",
    "CriticSettings",
    "ActorSettings",
    "SECTIONS",
    "VERL_ALIASES",
    "aliases_of",
]

_Verl = ClassVar[Mapping[str, tuple[str, ...]]]


class DataSettings(SourceSettings):
    """`prompt_source`'s settings (``data.*``)."""

    verl: _Verl = {"batch_size": ("data.train_batch_size",), "path": ("data.train_files",),
                   "val_path": ("data.val_files",)}

    path: str = ""
    """parquet or JSONL file of prompts in verl's layout; empty: generate data.task"""
    val_path: str = ""
    """parquet or JSONL file of validation prompts (read in order); empty: the generated task's test split, or
    no validation when data.path is set"""
    tokenizer: str = ""
    """HF directory whose tokenizer and chat template encode the prompts; empty: actor.model_path's (the
    policy's own); char: the built-in character tokenizer of the tiny models"""
    max_prompt_length: int = Field(64, ge=1)
    """longest prompt in tokens, chat template included"""
    filter_overlong_prompts: bool = True
    """drop (and count) prompts longer than max_prompt_length; false: such a prompt is an error naming its row"""
    shuffle: bool = True
    """shuffle prompts each epoch (seeded by trainer.seed and the epoch)"""
    task: Literal["add", "count", "mul", "guess"] = "add"
    """built-in task generated when data.path is empty"""
    num_rows: int = Field(1024, ge=1)
    """train rows generated when data.path is empty"""
    num_val_rows: int = Field(64, ge=1)
    """validation rows generated when data.path and data.val_path are empty"""
    reader: Literal["auto", "ray", "local"] = "auto"
    """how files are read: ray (Ray Data), local (pyarrow; JSONL line by line), auto (ray when Ray runs in the
    process with a CPU free, else local)"""


class RolloutSettings(Section):
    """`generate`'s settings (``rollout.*``)."""

    namespace: ClassVar[str] = "rollout"
    verl: _Verl = {
        "n": ("actor_rollout_ref.rollout.n",),
        "temperature": ("actor_rollout_ref.rollout.temperature",),
        "top_p": ("actor_rollout_ref.rollout.top_p",),
        "top_k": ("actor_rollout_ref.rollout.top_k",),
        "max_new_tokens": ("data.max_response_length", "actor_rollout_ref.rollout.response_length"),
        "gpu_memory_utilization": ("actor_rollout_ref.rollout.gpu_memory_utilization",),
        "enforce_eager": ("actor_rollout_ref.rollout.enforce_eager",),
    }

    n: int = Field(4, ge=1)
    """responses sampled per prompt (the group size)"""
    backend: Literal["hf", "vllm"] = Field("hf", json_schema_extra=SETUP)
    """hf: transformers generate, a micro-batch at a time; vllm: a vLLM engine per rank, continuous batching
    (install with scripts/setup.sh --vllm=cpu or rlgraph[vllm])"""
    model_path: str = Field("", json_schema_extra=SETUP)
    """policy model directory for a generation-only group (default: actor.model_path)"""
    temperature: float = Field(1.0, ge=0.0)
    """sampling temperature (0: greedy)"""
    top_p: float = Field(1.0, ge=0.0)
    """nucleus sampling mass"""
    top_k: int = Field(0, ge=0)
    """sample from the k most likely tokens (0: off)"""
    max_new_tokens: int = Field(16, ge=1)
    """response length limit in tokens"""
    stop_token_ids: str = ""
    """token ids that end a response besides EOS, comma-separated (e.g. '7,9')"""
    micro_batch_size: int = Field(0, ge=0)
    """hf: prompts per transformers generate call (each call's samples are handed on when it ends); 0: as many
    as fit rollout.max_batch_tokens. vllm: unused, the engine batches continuously"""
    max_batch_tokens: int = Field(16384, ge=1)
    """hf with micro_batch_size=0: a generate call takes prompts while its samples x (longest prompt +
    max_new_tokens) stay within this many tokens (at least one prompt a call)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", json_schema_extra=SETUP)
    """vllm: weights' dtype (auto: the model's on a GPU, float32 on CPU)"""
    max_model_len: int = Field(0, ge=0, json_schema_extra=SETUP)
    """vllm: longest prompt + response in tokens (0: the model's own limit)"""
    gpu_memory_utilization: float = Field(0.5, ge=0.0, json_schema_extra=SETUP)
    """vllm on a GPU: share of its memory the engine may take"""
    cpu_kv_cache_gb: int = Field(1, ge=1, json_schema_extra=SETUP)
    """vllm on CPU: KV-cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)"""
    enforce_eager: bool = Field(True, json_schema_extra=SETUP)
    """vllm: run the model eagerly (no CUDA graphs or compilation: quick to start)"""
    sleep_mode: bool = Field(True, json_schema_extra=SETUP)
    """vllm on a GPU shared with the update: free the engine's memory during the update and wake it before
    generating"""
    partial: bool = False
    """partial rollout, with trainer.max_staleness >= 1: weights the update writes while a generate call runs
    are loaded at once (vllm: between engine steps, so a response may start under one policy version and
    finish under the next, recorded in policy_version and policy_version_end; hf: between micro-batches).
    Fresher samples, but which tokens each version made depends on timing: a resume does not repeat them bit
    for bit"""


class AgentSettings(Section):
    """`agent_rollout`'s own settings. They live beside the sampling ones in ``rollout.*``: the agent op
    is the rollout (rollout.n, rollout.temperature, ... apply; rollout.max_new_tokens limits each model
    turn)."""

    namespace: ClassVar[str] = "rollout"

    env: str = ""
    """'module:Class' or 'file.py:Class' of an Environment, one per trajectory (empty: tool use with
    rollout.tools in rollout.tool_format, a turn without a call being the answer)"""
    tools: str = ""
    """tools the model may call: 'module:fn,file.py:other' (functions, @tool objects or lists of them)"""
    tool_format: str = "hermes"
    """how the model calls tools: hermes (<tool_call>{json}</tool_call>), inline ([name text]) or
    'module:Class' (a ToolFormat)"""
    max_turns: int = Field(4, ge=1)
    """model turns per trajectory at most"""
    max_response_tokens: int = Field(256, ge=1)
    """a trajectory's model and observation tokens together at most (then it is cut: truncated)"""
    max_obs_tokens: int = Field(64, ge=1)
    """tokens of one observation at most (a longer tool or environment answer is cut)"""
    tool_concurrency: int = Field(8, ge=1)
    """tool calls running at once per worker, over all trajectories"""
    tool_timeout_s: float = Field(10.0, ge=0.0)
    """time limit of one tool call (0: none); a tool's own @tool(timeout_s=) wins"""
    env_timeout_s: float = Field(60.0, ge=0.0)
    """time limit of one environment step (0: none); an overrun ends the trajectory"""


class RewardSettings(Section):
    """`reward`'s settings (``reward.*``, or the op's name)."""

    namespace: ClassVar[str] = "reward"

    tokenizer: str = ""
    """tokenizer directory for decoding responses (default: data.tokenizer, then actor.model_path); char: the
    built-in character tokenizer"""
    fn: str = "rlgraph.ops.reward.functions:compute_score"
    """'module:function' or 'file.py:function' with signature compute_score(data_source, solution_str,
    ground_truth, extra_info=None) -> float | dict; may be async def"""
    micro_batch_size: int = Field(64, ge=1)
    """samples per chunk: a call goes to one reward worker and holds its ready chunks (or the rows of the call it
    is fused into), all decoded and scored at once"""
    executor: Literal[EXECUTORS] = "thread"  # type: ignore[valid-type]
    """how a worker scores a call's samples concurrently: thread (I/O-bound functions) or process (CPU-heavy;
    a timed-out sample's process is killed); async def functions always run on an event loop"""
    concurrency: int = Field(8, ge=1)
    """samples scored at once per worker"""
    timeout_s: float = Field(60.0, ge=0.0)
    """time limit per sample, from its start (0: none; then, with the thread executor, a call whose samples' measured
    work is under 2 ms is scored on the op's own thread, without a hand-off to the scoring threads)"""
    on_error: Literal[ON_ERROR] = "fail"  # type: ignore[valid-type]
    """a sample whose function raised or timed out: fail the step, score it zero, or drop its group from
    training (drop_group)"""


class RewardModelSettings(Section):
    """`reward_model`'s settings (``reward_model.*``, whatever the op's name)."""

    namespace: ClassVar[str] = "reward_model"

    model_path: str = Field("", json_schema_extra=SETUP)
    """directory of a Hugging Face sequence-classification model (num_labels=1) with its tokenizer"""
    micro_batch_size: int = Field(32, ge=1)
    """samples per forward pass"""
    offload: bool = Field(True, json_schema_extra=SETUP)
    """on a GPU, keep the model on the CPU between calls (wake, score, sleep)"""
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", json_schema_extra=SETUP)
    """weights' dtype"""
    check_tokenizer: bool = Field(True, json_schema_extra=SETUP)
    """refuse a reward model whose tokenizer maps the policy's tokens to other ids (it reads the policy's token
    ids directly)"""


class JudgeSettings(Section):
    """`reward_model(kind="generative")`'s settings (``judge.*``): a served model asked to grade each response.
    The judge's worker reads them when it starts."""

    namespace: ClassVar[str] = "judge"

    backend: Literal["vllm", "openai"] = Field("vllm", json_schema_extra=SETUP)
    """vllm: a vLLM engine per rank of the op's worker group (its own pool, or colocated); openai: an
    OpenAI-compatible chat completions endpoint at judge.url"""
    model_path: str = Field("", json_schema_extra=SETUP)
    """backend=vllm: the judge, a local Hugging Face causal LM directory (its chat template is used when it has one)"""
    url: str = Field("", json_schema_extra=SETUP)
    """backend=openai: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1 (POST {url}/chat/completions)"""
    model: str = Field("", json_schema_extra=SETUP)
    """backend=openai: the served model's name"""
    api_key_env: str = Field("OPENAI_API_KEY", json_schema_extra=SETUP)
    """backend=openai: the environment variable holding the API key (sent as a bearer token when set; never put
    the key itself in the config)"""
    template: str = Field("Grade the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
                          "Reply with 'Score: N'.", json_schema_extra=SETUP)
    """the judge's prompt; {prompt}, {response} and {ground_truth} are replaced by the sample's"""
    score_pattern: str = Field(r"Score:\s*(-?\d+(?:\.\d+)?)", json_schema_extra=SETUP)
    """regular expression whose first group is the score in the judge's answer (the first match counts)"""
    score_scale: float = Field(10.0, ge=1e-9, json_schema_extra=SETUP)
    """the parsed score is divided by this (0..10 -> 0..1)"""
    max_new_tokens: int = Field(32, ge=1, json_schema_extra=SETUP)
    """longest answer of the judge"""
    temperature: float = Field(0.0, ge=0.0, json_schema_extra=SETUP)
    """the judge's sampling temperature (0: greedy)"""
    timeout_s: float = Field(60.0, ge=0.01, json_schema_extra=SETUP)
    """one judgement's deadline (one request; with vllm, the call's whole batch)"""
    retries: int = Field(2, ge=0, json_schema_extra=SETUP)
    """backend=openai: attempts after a failed request (a time-out, a connection error, a 5xx or 429), with
    exponential back-off; an unparsable answer is not retried"""
    concurrency: int = Field(8, ge=1, json_schema_extra=SETUP)
    """backend=openai: requests in flight at once"""
    on_error: Literal[ON_ERROR] = Field("fail", json_schema_extra=SETUP)  # type: ignore[valid-type]
    """a sample whose judgement timed out, failed or could not be parsed: fail the step (naming the answer), score
    it 0 (zero), or leave its group out of training (drop_group); each is counted in the op's metrics"""
    micro_batch_size: int = Field(32, ge=1)
    """samples per call"""
    gpu_memory_utilization: float = Field(0.3, ge=0.0, json_schema_extra=SETUP)
    """backend=vllm on a GPU: share of its memory the judge's engine may take"""


class OverlongSettings(Section):
    """`overlong_penalty`'s settings (``overlong.*``, or the op's name)."""

    namespace: ClassVar[str] = "overlong"

    score_column: str = Field(json_schema_extra=FIXED)
    """the score column the penalty is added to (set by the declaration)"""
    buffer_len: int = Field(4, ge=1)
    """overlong buffer: the last this many tokens before the maximum length are penalised linearly (DAPO's
    overlong_buffer.len)"""
    penalty_factor: float = Field(1.0, ge=0.0)
    """penalty at the maximum length (DAPO's overlong_buffer.penalty_factor)"""
    max_response_length: int = Field(0, ge=0)
    """the maximum response length the buffer ends at (0: rollout.max_new_tokens)"""


class FilterGroupsSettings(Section):
    """`filter_groups`'s settings (``filter_groups.*``, or the op's name)."""

    namespace: ClassVar[str] = "filter_groups"

    score_column: str = Field(json_schema_extra=FIXED)
    """the score column passed on as token_level_scores (set by the declaration)"""
    metric_column: str = Field(json_schema_extra=FIXED)
    """the column whose per-sample sum must vary within a group (set by the declaration:
    filter_groups(metric_column=...))"""
    min_std: float = Field(0.0, ge=0.0)
    """a group whose metric has a standard deviation at most this is dropped (0: only groups whose samples all
    scored the same)"""
    micro_batch_size: int = Field(16, ge=1)
    """groups per call"""
    max_rounds: int = Field(4, ge=1)
    """generation rounds per step at most, the first included (verl's max_num_gen_batches): each round scores
    fresh prompts until the kept groups fill data.batch_size; 1: no refill, the step trains on what its one
    round kept"""
    on_exhaust: Literal["train", "fail"] = "train"
    """when max_rounds rounds kept fewer than data.batch_size groups: train on the groups kept (train) or stop
    the run with an error (fail, as verl)"""


class ForwardSettings(Section):
    """What every forward pass over the responses has (``old_logprob``, ``ref``, ``values``)."""

    micro_batch_size: int = Field(16, ge=1)
    """samples per forward pass on a rank"""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """split each call's samples into forward passes of at most this many tokens (prompt + response; a longer
    sample alone); 0: one pass per call (verl: log_prob_max_token_len_per_gpu)"""


class OldLogprobSettings(ForwardSettings):
    """`old_logprob`'s settings (``old_logprob.*``)."""

    namespace: ClassVar[str] = "old_logprob"
    verl: _Verl = {"micro_batch_size": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",),
                   "max_tokens_per_micro_batch": ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",)}

    compare_rollout: bool = True
    """compare with the rollout engine's log-probs of the same tokens (rollout_probs_diff_mean/max metrics);
    makes generate return them"""


class RefSettings(ForwardSettings):
    """`ref`'s settings (``ref.*``)."""

    namespace: ClassVar[str] = "ref"
    verl: _Verl = {"micro_batch_size": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",),
                   "max_tokens_per_micro_batch": ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",)}

    model_path: str = ""
    """reference model directory (default: actor.model_path)"""


class TeacherSettings(ForwardSettings):
    """`teacher_logprob`'s settings (``teacher.*``): the teacher of on-policy distillation."""

    namespace: ClassVar[str] = "teacher"

    model_path: str = Field("", json_schema_extra=SETUP)
    """the teacher: a local Hugging Face causal LM with the student's tokenizer (another tokenizer is a compile
    error)"""
    backend: Literal["hf", "vllm"] = Field("hf", json_schema_extra=SETUP)
    """hf: a transformers forward on the op's worker group (chunked log-probs, actor.packing's layout); vllm: a
    vLLM engine per rank scoring prompt + response as a prompt (its prompt log-probs)"""
    temperature: float = Field(1.0, ge=0.01, json_schema_extra=SETUP)
    """the temperature of the teacher's log-probs (the student's are at rollout.temperature; keep both at 1 for the
    reverse KL of the two models' own distributions); the vllm backend takes 1 only"""
    gpu_memory_utilization: float = Field(0.3, ge=0.0, json_schema_extra=SETUP)
    """vllm on a GPU: share of its memory the teacher's engine may take"""
    top_k: int = Field(0, ge=0, json_schema_extra=SETUP)
    """also write the teacher's k most likely next tokens at every response position and their log-probs
    (teacher_topk_ids, teacher_topk_log_probs) for the update's dense distillation loss (actor.distill_coef);
    a k at or above the vocabulary size is the whole distribution (vllm: its prompt log-probs' top-k, the engine's
    max_logprobs raised to it); 0: off"""


class ValuesSettings(ForwardSettings):
    """`values`'s settings (``values.*``)."""

    namespace: ClassVar[str] = "values"


class AlgorithmSettings(Section):
    """`advantage`'s settings (``algorithm.*``); ``advantage(estimator)`` declares the estimator."""

    namespace: ClassVar[str] = "algorithm"
    verl: _Verl = {
        "estimator": ("algorithm.adv_estimator",),
        "kl_ctrl": ("algorithm.kl_ctrl.type",),
        "kl_coef": ("algorithm.kl_ctrl.kl_coef",),
        "kl_target": ("algorithm.kl_ctrl.target_kl",),
        "kl_horizon": ("algorithm.kl_ctrl.horizon",),
    }

    estimator: Literal[ESTIMATORS]  # type: ignore[valid-type]
    """advantage estimator"""
    gamma: float = Field(1.0, ge=0.0)
    """discount factor"""
    lam: float = Field(1.0, ge=0.0)
    """GAE lambda"""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (false: Dr.GRPO)"""
    use_kl_in_reward: bool = False
    """subtract kl_coef * KL(policy || ref) from token rewards"""
    kl_penalty: Literal[KL_KINDS] = "kl"  # type: ignore[valid-type]
    """KL estimator for the reward penalty"""
    kl_coef: float = Field(0.001, ge=0.0)
    """initial KL coefficient"""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """fixed or adaptive KL coefficient"""
    kl_target: float = Field(0.1, ge=0.0)
    """adaptive controller's KL target"""
    kl_horizon: int = Field(10000, ge=1)
    """adaptive controller's horizon"""
    distill_task_weight: float = Field(0.0, ge=0.0)
    """estimator=distill: add this weight times the task reward's GRPO advantage (group-normalised score) to the
    per-token reverse-KL advantage; 0: distillation alone"""
    distill_kl_weight: float = Field(1.0, ge=0.0)
    """estimator=distill: the weight of the per-token reverse-KL advantage (log p_teacher - log p_student of the
    sampled token); 0 leaves the teacher's signal to the update's dense loss (actor.distill_coef)"""


class UpdateSettings(Section):
    """What both updates have (``actor.*``, ``critic.*``); each declares its learning rate's default."""

    model_path: str = Field("", json_schema_extra=SETUP)
    """local Hugging Face model directory (the critic defaults to actor.model_path)"""
    lr: float = Field(ge=0.0)
    """learning rate"""
    mini_batch_size: int = Field(4, ge=1)
    """prompts per mini-batch (x n samples)"""
    micro_batch_size: int = Field(8, ge=1)
    """samples per micro-batch on a rank (gradient accumulation)"""
    ppo_epochs: int = Field(1, ge=1)
    """passes over the batch per step"""
    grad_clip: float = Field(1.0, ge=0.0)
    """max global gradient norm (0: off)"""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay"""
    lr_warmup_steps: int = Field(0, ge=0)
    """linear LR warm-up, in optimizer steps"""
    loss_agg_mode: Literal[AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    """how token losses are aggregated"""
    backend: Literal[ENGINE_BACKENDS] = "torch"  # type: ignore[valid-type]
    """torch (DDP over gloo/nccl: every rank holds the whole model and optimizer), deepspeed (ZeRO, see
    zero_stage) or fsdp2 (torch's fully_shard: weights, gradients and optimizer state sharded over the ranks;
    verl: strategy=fsdp2)"""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage (backend=deepspeed)"""
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field("auto", json_schema_extra=SETUP)
    """backend=fsdp2: bf16 computes in bfloat16 with float32 master weights and float32 gradient reduction; auto:
    bf16 on a CUDA GPU that supports it, fp32 elsewhere (CPU)"""
    cpu_offload: bool = Field(False, json_schema_extra=SETUP)
    """backend=fsdp2 on a GPU: keep weight shards, gradients and optimizer state in CPU memory between uses (on a
    CPU device they are there already)"""
    gradient_checkpointing: bool = Field(False, json_schema_extra=SETUP)
    """recompute each layer's activations in the backward pass instead of keeping them (less memory, about a
    third more compute; verl: enable_gradient_checkpointing)"""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """form micro-batches by a token budget instead of micro_batch_size samples: the fewest parts of a
    mini-batch whose prompt + response tokens fit it (a longer sample alone), as many on every rank, with the
    batch's samples first balanced over the dp ranks by length; 0: off (verl: use_dynamic_bsz with
    ppo_max_token_len_per_gpu)"""


class CriticSettings(UpdateSettings):
    """`update_critic`'s settings (``critic.*``)."""

    namespace: ClassVar[str] = "critic"
    verl: _Verl = {
        "model_path": ("critic.model.path",),
        "lr": ("critic.optim.lr",),
        "mini_batch_size": ("critic.ppo_mini_batch_size",),
        "micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu",),
        "backend": ("critic.strategy",),
        "max_tokens_per_micro_batch": ("critic.ppo_max_token_len_per_gpu",),
        "gradient_checkpointing": ("critic.model.enable_gradient_checkpointing",),
    }

    lr: float = Field(1e-5, ge=0.0)
    """learning rate"""
    cliprange_value: float = Field(0.5, ge=0.0)
    """value clip range around the old values"""


class ActorSettings(UpdateSettings):
    """`update_actor`'s settings (``actor.*``)."""

    namespace: ClassVar[str] = "actor"
    verl: _Verl = {
        "model_path": ("actor_rollout_ref.model.path",),
        "mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
        "micro_batch_size": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
        "ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs",),
        "clip_ratio_low": ("actor_rollout_ref.actor.clip_ratio_low",),
        "clip_ratio_high": ("actor_rollout_ref.actor.clip_ratio_high",),
        "clip_ratio_c": ("actor_rollout_ref.actor.clip_ratio_c",),
        "entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff",),
        "use_kl_loss": ("actor_rollout_ref.actor.use_kl_loss",),
        "kl_loss_coef": ("actor_rollout_ref.actor.kl_loss_coef",),
        "kl_loss_type": ("actor_rollout_ref.actor.kl_loss_type",),
        "loss_agg_mode": ("actor_rollout_ref.actor.loss_agg_mode",),
        "loss_mode": ("actor_rollout_ref.actor.policy_loss.loss_mode",),
        "grad_clip": ("actor_rollout_ref.actor.grad_clip",),
        "lr": ("actor_rollout_ref.actor.optim.lr",),
        "weight_decay": ("actor_rollout_ref.actor.optim.weight_decay",),
        "lr_warmup_steps": ("actor_rollout_ref.actor.optim.lr_warmup_steps",),
        "backend": ("actor_rollout_ref.actor.strategy", "actor.strategy"),
        "max_tokens_per_micro_batch": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",),
        "gradient_checkpointing": ("actor_rollout_ref.model.enable_gradient_checkpointing",),
        "packing": ("actor_rollout_ref.model.use_remove_padding",),
        "lora_rank": ("actor_rollout_ref.model.lora_rank", "actor.lora.rank"),
        "lora_alpha": ("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha"),
        "lora_target_modules": ("actor_rollout_ref.model.target_modules", "actor.lora.target_modules"),
        "cpu_offload": ("actor_rollout_ref.actor.fsdp_config.offload_policy",),
    }

    lr: float = Field(1e-6, ge=0.0)
    """learning rate"""
    clip_ratio_low: float = Field(0.2, ge=0.0)
    """PPO clip below 1 (eps_low)"""
    clip_ratio_high: float = Field(0.2, ge=0.0)
    """PPO clip above 1 (eps_high)"""
    clip_ratio_c: float = Field(3.0, ge=1.0)
    """dual-clip bound for negative advantages"""
    loss_mode: Literal[LOSS_MODES] = "vanilla"  # type: ignore[valid-type]
    """policy loss: vanilla (PPO clip, dual clip, per token) or gspo (one ratio per sequence, the geometric mean
    of its token ratios, clipped per sequence, aggregated seq-mean-token-mean; use clip ratios like 3e-4 /
    4e-4)"""
    entropy_coeff: float = Field(0.0, ge=0.0)
    """entropy bonus coefficient"""
    use_kl_loss: bool = False
    """add kl_loss_coef * KL(policy || ref) to the loss (GRPO style)"""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """KL loss coefficient"""
    kl_loss_type: Literal[KL_KINDS] = "low_var_kl"  # type: ignore[valid-type]
    """KL estimator for the loss"""
    tis_cap: float = Field(0.0, ge=0.0)
    """truncated importance sampling against the rollout engine: weight each token's policy loss by
    min(exp(old_log_probs - rollout_log_probs), tis_cap); 0: off"""
    decoupled_cap: float = Field(0.0, ge=0.0)
    """decoupled PPO (AReaL) for off-policy samples: clip the ratio against old_log_probs (the proximal policy,
    recomputed by the current one) and weight each token by exp(old_log_probs - rollout_log_probs), dropping
    tokens whose weight exceeds this cap (> 1; AReaL uses 5); 0: off"""
    distill_coef: float = Field(0.0, ge=0.0)
    """on-policy distillation's dense loss (GKD): add this weight times the divergence between the student's and
    the teacher's next-token distributions at every response token, over the teacher's top-k tokens plus the
    rest of the vocabulary as one outcome; needs stages.teacher_logprob() with teacher.top_k > 0; 0: off"""
    distill_beta: float = Field(0.5, ge=0.0, le=1.0)
    """the divergence of distill_coef, as TRL's GKD beta: 0 forward KL(teacher || student), 1 reverse
    KL(student || teacher), between: the generalised Jensen-Shannon divergence JSD_beta"""
    packing: bool = Field(False, json_schema_extra=SETUP)
    """padding-free forward and backward passes of the policy (update, old_logprob, ref): a micro-batch's samples
    end to end in one row, positions restarting per sample, attention kept within each; no padding token is
    computed (verl: use_remove_padding)"""
    logprob_chunk_size: int = Field(1024, ge=0, json_schema_extra=SETUP)
    """log-probs and entropy are computed this many positions at a time from the last hidden states (the
    [tokens, vocab] logits are never held whole; in training each chunk is recomputed in the backward pass);
    0: the whole response at once"""
    lora_rank: int = Field(0, ge=0, json_schema_extra=SETUP)
    """train LoRA adapters of this rank (peft) instead of all weights; the reference log-probs come from the same
    model with the adapters off; 0: full fine-tuning (also accepted as actor.lora.rank)"""
    lora_alpha: float = Field(16.0, ge=0.0, json_schema_extra=SETUP)
    """LoRA scale numerator: adapters add (lora_alpha / lora_rank) * B @ A (also actor.lora.alpha)"""
    lora_target_modules: str = Field("all-linear", json_schema_extra=SETUP)
    """the linear layers that get adapters: all-linear, or comma-separated module names such as q_proj,v_proj
    (also actor.lora.target_modules)"""
    lora_dropout: float = Field(0.0, ge=0.0, json_schema_extra=SETUP)
    """dropout on the adapters' input in training"""


# every built-in section, the trainer's, the data plane's and the cluster's included
SECTIONS: tuple[type[Section], ...] = (
    TrainerSettings, DataplaneSettings, ClusterSettings, DataSettings, RolloutSettings, RewardSettings,
    RewardModelSettings, JudgeSettings, OverlongSettings, FilterGroupsSettings, OldLogprobSettings, RefSettings,
    TeacherSettings, ValuesSettings, AlgorithmSettings, CriticSettings, ActorSettings,
)

# verl key -> rlgraph key, from the sections' verl tables (`rlgraph.graph.verl` translates a pipeline's
# overrides by the verl keys of its own params; this is the whole table, for the docs and the tests)
VERL_ALIASES: Mapping[str, str] = MappingProxyType(verl_aliases(SECTIONS))


def aliases_of(key: str) -> list[str]:
    """The verl keys that stand for rlgraph's `key` (``rollout.max_new_tokens``)."""
    return [verl for verl, ours in VERL_ALIASES.items() if ours == key]
