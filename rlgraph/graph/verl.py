"""verl's config keys as aliases of rlgraph's: each key's verl names are declared with it, nothing guessed.

A verl user's overrides (``data.train_batch_size=256``, ``actor_rollout_ref.rollout.n=8``,
``algorithm.adv_estimator=grpo``) are renamed to rlgraph's keys before the config is resolved,
each with a one-line notice naming the rlgraph key. A verl key that rlgraph has no equivalent
for is an error that says so and what to do instead; it is never silently ignored. Keys that
verl and rlgraph spell the same (``algorithm.gamma``, ``trainer.critic_warmup``, ``trainer.logger``)
need no alias.

Which verl keys stand for a key is declared with its settings (the ``verl`` table of its model in
`rlgraph.graph.settings` and `rlgraph.ops.settings`) and carried by its `Param`, so a pipeline's
overrides are translated by the aliases of the keys it has; `rlgraph.ops.settings.VERL_ALIASES` is
the whole table of the built-in sections.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Mapping

from rlgraph.errors import Problem
from rlgraph.graph.config import Param

__all__ = ["VERL_UNSUPPORTED", "VerlAliasNotice", "translate_verl_keys"]

# verl's "never" for a frequency is -1; rlgraph's is 0
_NEVER = {"trainer.save_freq", "trainer.test_freq"}

# common verl keys with no rlgraph equivalent, and what to do instead
VERL_UNSUPPORTED: Mapping[str, str] = MappingProxyType({
    "actor_rollout_ref.actor.clip_ratio": "set actor.clip_ratio_low and actor.clip_ratio_high",
    "actor_rollout_ref.rollout.name": "set rollout.backend (hf or vllm)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rlgraph's vLLM rollout runs one engine per rank "
                                                            "without tensor parallelism",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "use actor.backend=fsdp2 with actor.cpu_offload=true",
    "trainer.default_local_dir": "pass the run directory with rlgraph run -o DIR",
    "trainer.val_before_train": "validation runs every trainer.val_every steps",
    "trainer.device": "devices come from the worker groups' num_gpus",
    "reward_model.reward_manager": "set the reward op's fn (and executor) instead",
    "custom_reward_function.path": "set reward.fn='file.py:function'",
    "custom_reward_function.name": "set reward.fn='file.py:function'",
})

# verl's switch for token-budget micro-batches -> the budget key it enables (verl's default budget: 16384);
# rlgraph has the budget only (0: off)
_DYNAMIC_BSZ: Mapping[str, str] = MappingProxyType({
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "critic.use_dynamic_bsz": "critic.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
})
_VERL_DEFAULT_BUDGET = "16384"
# verl's training strategies -> rlgraph's backend (FSDP1 is taken as FSDP2, its successor)
_STRATEGIES = {"fsdp": "fsdp2", "fsdp2": "fsdp2"}
_STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor.strategy", "critic.strategy")
# rlgraph's own other spellings, declared in the same tables (not verl keys)
_SPELLINGS = frozenset({"actor.strategy", "actor.lora.rank", "actor.lora.alpha", "actor.lora.target_modules"})

# top-level sections only verl has: any key under them is a verl key
_VERL_ONLY = ("actor_rollout_ref.", "custom_reward_function.")


class VerlAliasNotice(UserWarning):
    """A verl config key was taken as the rlgraph key it stands for."""


def translate_verl_keys(raw: Mapping[str, str], schema: Mapping[str, Param]) -> tuple[dict[str, str], list[Problem]]:
    """Rename verl keys in `raw` (override key -> raw value) to the keys of `schema` whose params name
    them (`Param.verl`), with a `VerlAliasNotice` each; a verl key without an equivalent becomes a
    problem. Keys of the pipeline's own schema are never renamed (a pipeline may declare a key that
    verl also uses)."""
    aliases: dict[str, list[str]] = {}
    for ours, param in schema.items():
        for verl in param.verl:
            aliases.setdefault(verl, []).append(ours)
    out: dict[str, str] = {}
    problems: list[Problem] = []
    raw = _dynamic_bsz(raw)
    for key, value in raw.items():
        if key in schema:
            out[key] = value
            continue
        if key in aliases:
            if len(aliases[key]) > 1:  # an op declared twice under other names: which one is meant?
                problems.append(Problem("config-unknown-key", f"{key!r} (verl's name) stands for "
                                        f"{' and '.join(repr(k) for k in aliases[key])} in this pipeline",
                                        f"set the one meant: {' or '.join(f'{k}={value}' for k in aliases[key])}"))
                continue
            ours = aliases[key][0]
            if ours in raw:
                problems.append(Problem("config-unknown-key", f"both {key!r} (verl's name) and {ours!r} are set",
                                        f"keep one: {ours}={raw[ours]} or {key}={value}"))
                continue
            if key in _NEVER and value.strip() == "-1":
                value = "0"
            if key in _STRATEGY_KEYS:
                if value.strip() == "megatron":
                    problems.append(Problem("config-unknown-key", f"{key}=megatron: rlgraph has no Megatron backend",
                                            f"set {ours}=fsdp2 (sharded weights, gradients and optimizer state) or "
                                            f"{ours}=deepspeed"))
                    continue
                value = _STRATEGIES.get(value.strip(), value)
            whose = "another name" if key in _SPELLINGS else "verl's name"
            warnings.warn(VerlAliasNotice(f"{key} is {whose} for {ours}; using {ours}={value}"), stacklevel=2)
            out[ours] = value
        elif key in VERL_UNSUPPORTED:
            problems.append(Problem("config-unknown-key", f"{key!r} is a verl config key with no rlgraph equivalent",
                                    VERL_UNSUPPORTED[key]))
        elif key.startswith(_VERL_ONLY):  # an alias of an op the pipeline lacks, or none at all
            problems.append(Problem("config-unknown-key", f"{key!r} is a verl config key with no equivalent among "
                                    "this pipeline's keys", "`rlgraph describe PIPELINE --config` lists every key "
                                    "of the pipeline with the verl keys that stand for it"))
        else:
            out[key] = value
    return out, problems


def _dynamic_bsz(raw: Mapping[str, str]) -> dict[str, str]:
    """verl's ``use_dynamic_bsz`` switches as the budget keys they enable: true gives the budget key its value
    (verl's default 16384 when unset), false drops it (verl ignores the budget then), each with a notice."""
    out = dict(raw)
    for flag, budget in _DYNAMIC_BSZ.items():
        if flag not in out:
            if budget in out:
                warnings.warn(VerlAliasNotice(f"{budget} without {flag}=true is ignored, as verl ignores it"),
                              stacklevel=3)
                out.pop(budget)
            continue
        on = out.pop(flag).strip().lower() in ("true", "1", "yes")
        if on:
            out.setdefault(budget, _VERL_DEFAULT_BUDGET)
            warnings.warn(VerlAliasNotice(f"{flag}=true: micro-batches by the token budget {budget}="
                                          f"{out[budget]}"), stacklevel=3)
        elif budget in out:
            warnings.warn(VerlAliasNotice(f"{flag}=false: {budget} is ignored, as verl ignores it"), stacklevel=3)
            out.pop(budget)
    return out
