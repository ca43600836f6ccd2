"""The reuse pass: old_logprob is left out exactly when the update's own first forward gives it."""

from __future__ import annotations

import pytest

from rlgraph import PipelineError, compile


def _ops(plan):
    return [o.name for o in plan.ops]


def test_one_mini_batch_of_one_epoch_leaves_old_logprob_out(grpo):
    plan = compile(grpo, ["actor.mini_batch_size=8"])  # the whole batch of 8 prompts: one optimizer step
    assert "old_logprob" not in _ops(plan)
    assert list(plan.reused) == ["old_logprob"]
    assert plan.reused["old_logprob"].startswith("its 'old_log_probs' is update_actor's own first forward")
    update = plan.op("update_actor")
    assert "old_log_probs" not in update.inputs and update.batching.updates_per_step == 1
    assert "old_log_probs" not in plan.columns  # nothing writes it
    assert ["old_logprob" in s for s in plan.schedule.stages] == [False] * len(plan.schedule.stages)


@pytest.mark.parametrize("overrides", [
    ["actor.mini_batch_size=4"],  # two mini-batches: the second one's forward runs on changed weights
    ["actor.mini_batch_size=8", "actor.ppo_epochs=2"],  # two epochs: likewise
    ["actor.mini_batch_size=8", "trainer.reuse_forward=false"],  # asked for the separate pass
    ["actor.mini_batch_size=8", "algorithm.use_kl_in_reward=true"],  # the advantage reads old log-probs too
    ["actor.mini_batch_size=8", "groups.actor.dp=2", "old_logprob.micro_batch_size=4"],  # dp changes nothing
])
def test_old_logprob_stays_when_its_result_is_not_the_update_s_forward(grpo, overrides):
    plan = compile(grpo, overrides)
    if "groups.actor.dp=2" in overrides:
        assert "old_logprob" not in _ops(plan)
        return
    assert "old_logprob" in _ops(plan) and not plan.reused
    assert "old_log_probs" in plan.op("update_actor").inputs


@pytest.mark.parametrize("correction", ["actor.tis_cap=2.0", "actor.decoupled_cap=5.0"])
def test_rollout_corrections_take_old_log_probs_from_the_update_too(grpo, correction):
    # truncated IS and decoupled PPO weigh tokens by the old log-probs: the update computes them itself
    # (tests/ops/train/test_actor_options.py checks it gives what the separate pass gave)
    plan = compile(grpo, ["actor.mini_batch_size=8", correction])
    assert "old_logprob" not in _ops(plan) and list(plan.reused) == ["old_logprob"]
    assert "rollout_log_probs" in plan.op("update_actor").inputs


def test_the_asynchronous_example_leaves_its_proximal_pass_out():
    from pathlib import Path

    from rlgraph.graph.loader import load_pipeline

    pipeline, _ = load_pipeline(str(Path(__file__).parents[2] / "examples" / "grpo_async.py"))
    plan = compile(pipeline)
    assert "old_logprob" not in _ops(plan) and "old_logprob" in plan.reused
    assert {o.name: o.group for o in plan.ops}["ref"] == "rollout"  # the reference beside generation


def test_an_update_without_old_log_probs_needs_one_optimizer_step_per_step(grpo):
    from dataclasses import replace

    no_old = replace(grpo, ops=tuple(o for o in grpo.ops if o.name != "old_logprob"))
    assert "old_logprob" not in _ops(compile(no_old, ["actor.mini_batch_size=8"]))  # its forward gives them
    with pytest.raises(PipelineError) as e:
        compile(no_old, ["actor.mini_batch_size=4"])
    (problem,) = [p for p in e.value.problems if p.code == "column-missing"]
    assert problem.message.startswith("op 'update_actor' reads column 'old_log_probs', which no op produces; "
                                      "update_actor can take it from its own forward only when")
    assert "stages.old_logprob()" in problem.fix
