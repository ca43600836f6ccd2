"""Pass 3, prune: a column is stored iff some op reads it, it is a pipeline output, or a metric."""

from __future__ import annotations

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op
from rlgraph.graph.build import build
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.prune import prune


@op(outputs={"score": T.float32(), "debug": T.str(), "judge_metrics": T.json().metric()}, group="workers")
def judge(prompt: T.str()):
    return 1.0, "", {}


def _pruned(pipeline, overrides=()) -> set[str]:
    return {col for col, stored in prune(build(pipeline, overrides)).items() if not stored}


def test_ppo_prunes_entropy_and_unread_rollout_log_probs(ppo) -> None:
    stored = prune(build(ppo))
    # 6 source columns (4 + uid, is_padding) + generate 10 (with policy_version and policy_version_end)
    # + reward 3 + old_logprob 3 + ref 1 + values 1 + advantage 4 + update_critic 2 + update_actor 2 = 32 columns
    assert len(stored) == 32
    # nobody reads entropy (no entropy bonus op), and it is not an output; old_logprob reads
    # rollout_log_probs to compare them with its own (compare_rollout, on by default); nobody reads the
    # prompts on their own (the rule reward scores the response; the model passes read input_ids)
    assert _pruned(ppo) == {"entropy", "prompts"}
    # without the comparison nobody reads them: pruned, and generate does not compute them (ctx.wanted)
    assert _pruned(ppo, ["old_logprob.compare_rollout=false"]) == {"entropy", "prompts", "rollout_log_probs"}


def test_ppo_keeps_its_outputs_and_metrics(ppo) -> None:
    stored = prune(build(ppo))
    # outputs=["token_level_rewards", "reward_extra"]: read by nobody, kept because listed
    assert stored["token_level_rewards"] and stored["reward_extra"]
    assert stored["actor_metrics"] and stored["critic_metrics"] and stored["advantage_metrics"]
    assert stored["returns"]  # read by update_critic


def test_grpo_prunes_returns(grpo) -> None:
    # no critic reads 'returns'; grpo lists no outputs, so token_level_rewards and reward_extra go too
    assert _pruned(grpo) == {"entropy", "prompts", "returns", "token_level_rewards", "reward_extra"}
    stored = prune(build(grpo))
    assert stored["advantage_metrics"] and stored["actor_metrics"]
    assert stored["policy_weights"]  # state, read by generate in the next step


def test_system_columns_and_metrics_are_always_stored() -> None:
    p = Pipeline("p", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
    stored = prune(build(p))
    assert stored == {
        "prompt": True,  # read by judge
        "uid": True,  # system column
        "is_padding": True,  # system column
        "score": False,  # nobody reads it
        "debug": False,
        "judge_metrics": True,  # a metric
    }


def test_outputs_make_a_column_stored_and_the_plan_says_so() -> None:
    p = Pipeline("p", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")], outputs=["score"])
    assert _pruned(p) == {"debug"}
    plan = compile_pipeline(p)
    assert plan.columns["score"].stored and not plan.columns["debug"].stored
    assert plan.columns["debug"].consumers == []
