"""The bundled examples with the small, fixed configs the compiler tests work out by hand.

The examples' own defaults are tuned for learning and may change; tests of the compiler and
the CLI pin these instead, so their hand-computed numbers stay valid. GRPO's is pinned with the
layout those tests were worked out for, a reward worker group of its own that runs the reward and
the advantage (examples/grpo_reward_pool.py; examples/grpo.py runs both on the policy's group).
"""

from dataclasses import replace
from pathlib import Path

from rlgraph import Pipeline
from rlgraph.graph.loader import import_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

PPO_CONFIG = {
    "data": {"batch_size": 8, "tokenizer": "char"},  # no actor.model_path here: the tokenizer is named
    "rollout": {"n": 4, "max_new_tokens": 16},
    "actor": {"lr": 1e-4, "mini_batch_size": 4},
    "algorithm": {"use_kl_in_reward": True, "kl_coef": 0.01},
    "critic": {"lr": 1e-4, "mini_batch_size": 4},
    "trainer": {"steps": 20},
}
GRPO_CONFIG = {
    "data": {"batch_size": 8, "tokenizer": "char"},
    "rollout": {"n": 8, "max_new_tokens": 16},
    "actor": {"lr": 1e-4, "mini_batch_size": 4, "use_kl_loss": True},
    "trainer": {"steps": 20},
}


def pinned(example: str, config: dict) -> Pipeline:
    p = import_file(EXAMPLES / f"{'grpo_reward_pool' if example == 'grpo' else example}.py").pipeline
    return replace(p, name=example, config=config, prepare=None, prepare_file=None)
