"""An agent that learns to use a calculator: GRPO over multi-turn rollouts with a tool.

The task (``mul``: "47*8=" -> "376") is beyond the tiny model on its own. It may call the
``calc`` tool by writing ``(calc 47*8)``; generation stops at the ``)``, the tool runs, and its
answer comes back as the observation ``=376)`` (``response_mask`` 0: never trained on); then the
model writes its answer. The reward is 1 for a correct final answer (`compute_score` on the
text after the last tool result). Before the first run ``prepare`` builds a tiny Qwen2-style
model and gives it a short warm start on a few such trajectories (observations not learned),
so it calls the tool some of the time and copies the result some of the time; RL does the rest.

    rlgraph run examples/agent_tools.py -o runs/agent_tools
    rlgraph validate examples/agent_tools.py        # resolves the tool and the call format
"""

from pathlib import Path

from rlgraph import Cluster, Pipeline, WorkerGroup
from rlgraph.ops import stages
from rlgraph.ops.agents import Inline, tool

MODEL = "~/.cache/rlgraph/models/tiny-agent-tools-v1"
SFT_STEPS = 100
HERE = Path(__file__).resolve()


class Calls(Inline):
    """``(calc 47*8)``, answered ``=376)``: the inline format with delimiters the tiny model's
    character vocabulary has."""

    open, close = "(", ")"


@tool(timeout_s=2.0)
def calc(expression: str) -> str:
    """Multiply or add two integers: '47*8' -> '376'."""
    for op in "*+":
        if op in expression:
            a, b = expression.split(op, 1)
            a, b = int(a.strip()), int(b.strip())
            return str(a * b if op == "*" else a + b)
    raise ValueError(f"no * or + in {expression!r}")


def prepare(config):
    """Build the tiny policy once and warm it up on tool-using trajectories."""
    from rlgraph.ops.data.tasks import make_rows
    from rlgraph.ops.models import build_once, build_tiny_model, sft_warmstart

    seed = config["trainer"]["seed"]

    def build(tmp):
        build_tiny_model(tmp, seed=seed)
        rows = make_rows("mul", 2048, seed=seed, split="train")
        traces = []
        for r in rows:
            a, b, answer = r["extra_info"]["a"], r["extra_info"]["b"], r["reward_model"]["ground_truth"]
            traces.append((r["prompt"], [(f"(calc {a}*{b})", True), (f"={answer})", False), (answer, True)]))
        sft_warmstart(tmp, traces, steps=SFT_STEPS, seed=seed)

    build_once(config["actor"]["model_path"], build)


pipeline = Pipeline(
    name="agent_tools",
    source=stages.prompt_source(),
    ops=[
        stages.agent_rollout(tools=f"{HERE}:calc", tool_format=f"{HERE}:Calls", group="actor"),
        stages.reward(group="reward"),
        stages.advantage("grpo", group="advantage"),
        stages.update_actor(group="actor"),
    ],
    groups=[
        WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: multi-turn rollouts and the update"),
        WorkerGroup("reward", dp=1, num_cpus=1, doc="rule-based reward of the final answer"),
        WorkerGroup("advantage", dp=1, num_cpus=0.5, doc="GRPO advantages"),
    ],
    cluster=Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=0),
    config={
        "data": {"batch_size": 16, "task": "mul"},
        "rollout": {"n": 8, "max_new_tokens": 12, "temperature": 1.0, "max_turns": 3, "max_response_tokens": 32,
                    "max_obs_tokens": 8},
        "actor": {"model_path": MODEL, "lr": 3e-4, "mini_batch_size": 16, "micro_batch_size": 64},
        "trainer": {"steps": 300},
    },
    prepare=prepare,
    summaries=stages.SUMMARIES,
)
