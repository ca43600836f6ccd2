"""A multi-turn environment: find a hidden digit, told "higher" or "lower" after each guess.

Each prompt (``guess 1234:``) hides a digit 1-9 (its ground truth). The model guesses (a digit
and EOS); the environment answers ``higher`` or ``lower`` (an observation, ``response_mask``
0), up to ``rollout.max_turns`` guesses; a right guess ends the game with reward 1, given by
the environment and put on the last token by `stages.env_reward`. Guessing blindly finds the
digit within 4 guesses about 38% of the time; using the answers (halving the range) always.
``prepare`` warms the tiny model up on games where it mostly guesses at random and sometimes
halves the range, so RL has to learn to read the environment's answers.

    rlgraph run examples/agent_guess.py -o runs/agent_guess
"""

import random
from pathlib import Path

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages
from rlgraph.ops.agents import Environment

MODEL = "~/.cache/rlgraph/models/tiny-agent-guess-v1"
SFT_STEPS = 150
SEARCH_SHARE = 0.3  # share of warm-start games that halve the range; the rest guess at random
HERE = Path(__file__).resolve()


class GuessDigit(Environment):
    """The hidden digit is the row's ground truth; each turn's first digit is the guess."""

    def reset(self, row):
        self.target = int(row["ground_truth"])
        return ""

    def step(self, action):
        digits = [c for c in action if c.isdigit()]
        if not digits:
            return "digit?", 0.0, False, {}
        guess = int(digits[0])
        if guess == self.target:
            return "", 1.0, True, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, {}


def _game(target: int, search: bool, rng: random.Random, turns: int = 4) -> list[tuple[str, bool]]:
    """A warm-start game: the model's guesses (learned) and the answers (not learned)."""
    lo, hi, out = 1, 9, []
    for _ in range(turns):
        guess = (lo + hi) // 2 if search else rng.randint(1, 9)
        out.append((f"{guess}<eos>", True))
        if guess == target:
            break
        answer = "higher" if guess < target else "lower"
        lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)
        out.append((answer, False))
    return out


def prepare(config):
    """Build the tiny policy once and warm it up on games."""
    from rlgraph.ops.data.tasks import make_rows
    from rlgraph.ops.models import build_once, build_tiny_model, sft_warmstart

    seed = config["trainer"]["seed"]

    def build(tmp):
        build_tiny_model(tmp, seed=seed)
        rng = random.Random(seed)
        games = []
        for r in make_rows("guess", 4096, seed=seed, split="train"):
            segments = _game(int(r["reward_model"]["ground_truth"]), rng.random() < SEARCH_SHARE, rng)
            text, learned = segments[-1]
            segments[-1] = (text.removesuffix("<eos>"), learned)  # sft_warmstart adds the last <eos>
            games.append((r["prompt"], segments))
        sft_warmstart(tmp, games, steps=SFT_STEPS, seed=seed)

    build_once(config["actor"]["model_path"], build)


pipeline = Pipeline(
    name="agent_guess",
    source=stages.prompt_source(),
    ops=[
        stages.agent_rollout(env=f"{HERE}:GuessDigit", group="actor"),
        stages.env_reward(group="reward"),
        stages.advantage("grpo", group="reward"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: multi-turn rollouts and the update"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="the environment's reward as the score, GRPO advantages"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 16, "task": "guess"},
        "rollout": {"n": 8, "max_new_tokens": 2, "temperature": 1.0, "max_turns": 4, "max_response_tokens": 32,
                    "max_obs_tokens": 8},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 16, "micro_batch_size": 64},
        "trainer": {"steps": 600},
    },
    prepare=prepare,
    summaries=stages.SUMMARIES,
)
