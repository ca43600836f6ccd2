"""verl's config keys as aliases of rlgraph's: one explicit table, nothing guessed.

A verl user's overrides (``data.train_batch_size=256``, ``actor_rollout_ref.rollout.n=8``,
``algorithm.adv_estimator=grpo``) are renamed to rlgraph's keys before the config is resolved,
each with a one-line notice naming the rlgraph key. A verl key that rlgraph has no equivalent
for is an error that says so and what to do instead; it is never silently ignored. Keys that
verl and rlgraph spell the same (``algorithm.gamma``, ``trainer.critic_warmup``, ``trainer.logger``)
need no alias.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Mapping

from rlgraph.errors import Problem

__all__ = ["VERL_ALIASES", "VERL_UNSUPPORTED", "VerlAliasNotice", "aliases_of", "translate_verl_keys"]

# verl key -> rlgraph key. Semantics match (prompts per step, per mini-batch; samples per micro-batch).
VERL_ALIASES: Mapping[str, str] = MappingProxyType({
    "data.train_batch_size": "data.batch_size",
    "data.train_files": "data.path",
    "data.val_files": "data.val_path",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.model.path": "actor.model_path",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "old_logprob.micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss": "actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "actor.kl_loss_type",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.loss_mode",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.lr_warmup_steps",
    "critic.model.path": "critic.model_path",
    "critic.optim.lr": "critic.lr",
    "critic.ppo_mini_batch_size": "critic.mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "algorithm.adv_estimator": "algorithm.estimator",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "trainer.total_training_steps": "trainer.steps",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "trainer.val_every",
    "trainer.nnodes": "cluster.num_nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
    "trainer.project_name": "trainer.project",
    "trainer.experiment_name": "trainer.run_name",
})

# verl's "never" for a frequency is -1; rlgraph's is 0
_NEVER = {"trainer.save_freq", "trainer.test_freq"}

# common verl keys with no rlgraph equivalent, and what to do instead
VERL_UNSUPPORTED: Mapping[str, str] = MappingProxyType({
    "actor_rollout_ref.actor.clip_ratio": "set actor.clip_ratio_low and actor.clip_ratio_high",
    "actor_rollout_ref.rollout.name": "set rollout.backend (hf or vllm)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rlgraph's vLLM rollout runs one engine per rank "
                                                            "without tensor parallelism",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "use actor.backend=deepspeed with actor.zero_stage=3",
    "actor_rollout_ref.actor.strategy": "set actor.backend (torch or deepspeed)",
    "trainer.default_local_dir": "pass the run directory with rlgraph run -o DIR",
    "trainer.val_before_train": "validation runs every trainer.val_every steps",
    "trainer.device": "devices come from the worker groups' num_gpus",
    "reward_model.reward_manager": "set the reward op's fn (and executor) instead",
    "custom_reward_function.path": "set reward.fn='file.py:function'",
    "custom_reward_function.name": "set reward.fn='file.py:function'",
})

# top-level sections only verl has: any key under them is a verl key
_VERL_ONLY = ("actor_rollout_ref.", "custom_reward_function.")


class VerlAliasNotice(UserWarning):
    """A verl config key was taken as the rlgraph key it stands for."""


def aliases_of(key: str) -> list[str]:
    """The verl keys that stand for rlgraph's `key` (for `rlgraph describe --config`)."""
    return [verl for verl, ours in VERL_ALIASES.items() if ours == key]


def translate_verl_keys(raw: Mapping[str, str], schema: Mapping[str, object]) -> tuple[dict[str, str], list[Problem]]:
    """Rename verl keys in `raw` (override key -> raw value) to rlgraph's, with a `VerlAliasNotice`
    each; a verl key without an equivalent becomes a problem. Keys of the pipeline's own schema
    are never renamed (a pipeline may declare a key that verl also uses)."""
    out: dict[str, str] = {}
    problems: list[Problem] = []
    for key, value in raw.items():
        if key in schema:
            out[key] = value
            continue
        if key in VERL_ALIASES:
            ours = VERL_ALIASES[key]
            if ours in raw:
                problems.append(Problem("config-unknown-key", f"both {key!r} (verl's name) and {ours!r} are set",
                                        f"keep one: {ours}={raw[ours]} or {key}={value}"))
                continue
            if key in _NEVER and value.strip() == "-1":
                value = "0"
            warnings.warn(VerlAliasNotice(f"{key} is verl's name for {ours}; using {ours}={value}"), stacklevel=2)
            out[ours] = value
        elif key in VERL_UNSUPPORTED or key.startswith(_VERL_ONLY):
            instead = VERL_UNSUPPORTED.get(key, "`rlgraph describe PIPELINE --config` lists every rlgraph key with "
                                                "the verl keys that stand for it")
            problems.append(Problem("config-unknown-key", f"{key!r} is a verl config key with no rlgraph equivalent",
                                    instead))
        else:
            out[key] = value
    return out, problems
