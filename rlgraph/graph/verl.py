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
            warnings.warn(VerlAliasNotice(f"{key} is verl's name for {ours}; using {ours}={value}"), stacklevel=2)
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
