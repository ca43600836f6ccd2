"""Pass 4, batch: the padding multiple (BRIEF section 2), padded sizes and mini/micro-batch counts.

m = lcm(dp of every worker group that reads per-sample data, mini_batch * n of every op that
splits the batch), the actor's terms only once step >= critic_warmup. All expected values are
worked out by hand in the comments. PPO's groups: actor, reward, critic, advantage (dp=1 unless
overridden); its updates default to mini_batch_size=4 prompts.
"""

from __future__ import annotations

import pytest

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op
from rlgraph.graph.batching import batch, group_size, op_batching
from rlgraph.graph.build import build
from rlgraph.graph.check import check
from rlgraph.graph.compile import compile_pipeline
from rlgraph.ops import stages

BIG = ["cluster.cpus_per_node=16"]  # room for larger dp without placement problems


@pytest.mark.parametrize(
    "overrides, global_batch, multiple, padded",
    [
        # defaults: 8 prompts x n=4 = 32; m = lcm(1, 1, 1, 1, 4*4=16, 4*4=16) = 16; 32 = 2 x 16
        ([], 32, 16, 32),
        # 45 x 8 = 360; dp actor 2; minis 15 x 8 = 120 both; m = lcm(2, 120) = 120; 360 = 3 x 120
        (["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2", "actor.mini_batch_size=15",
          "critic.mini_batch_size=15"], 360, 120, 360),
        # actor mini 16 x 8 = 128 = 2^7, critic 15 x 8 = 120 = 2^3*3*5: m = lcm(2, 128, 120) = 2^7*3*5 = 1920;
        # 360 rounds up to 1920
        (["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2", "actor.mini_batch_size=16",
          "critic.mini_batch_size=15"], 360, 1920, 1920),
        # 10 x 3 = 30; dp actor 4; minis 5 x 3 = 15: m = lcm(4, 15) = 60; 30 rounds up to 60
        (["data.batch_size=10", "rollout.n=3", "groups.actor.dp=4", "actor.mini_batch_size=5",
          "critic.mini_batch_size=5", *BIG], 30, 60, 60),
        # 7 x 5 = 35; dp critic 3, reward 2; minis 7 x 5 = 35: m = lcm(3, 2, 35) = 210; 35 rounds up to 210
        (["data.batch_size=7", "rollout.n=5", "groups.critic.dp=3", "groups.reward.dp=2",
          "actor.mini_batch_size=7", "critic.mini_batch_size=7", *BIG], 35, 210, 210),
        # 6 x 1 = 6; dp advantage 4; minis 3 x 1 = 3 and 2 x 1 = 2: m = lcm(4, 3, 2) = 12; 6 rounds up to 12
        (["data.batch_size=6", "rollout.n=1", "groups.advantage.dp=4", "actor.mini_batch_size=3",
          "critic.mini_batch_size=2", *BIG], 6, 12, 12),
    ],
)
def test_padding_multiple_and_padded_batch(ppo, overrides, global_batch, multiple, padded) -> None:
    plan = compile_pipeline(ppo, overrides).batch
    assert plan.global_batch == global_batch
    assert plan.multiple == multiple
    assert plan.padded_batch == padded
    assert plan.pad_rows == padded - global_batch
    assert plan.critic_warmup == 0
    assert (plan.multiple_warmup, plan.padded_batch_warmup) == (multiple, padded)  # no warm-up: same


def test_terms_say_where_each_factor_comes_from(ppo) -> None:
    plan = compile_pipeline(ppo, ["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2",
                                  "actor.mini_batch_size=16", "critic.mini_batch_size=15"]).batch
    terms = {t.source: t.value for t in plan.terms}
    assert terms == {
        "dp of worker group 'actor'": 2,
        "dp of worker group 'reward'": 1,
        "dp of worker group 'critic'": 1,
        "dp of worker group 'advantage'": 1,
        "update_critic: critic.mini_batch_size=15 x n=8": 120,
        "update_actor: actor.mini_batch_size=16 x n=8": 128,
    }


def test_critic_warmup_multiple_excludes_the_actor_term(ppo) -> None:
    plan = compile_pipeline(ppo, ["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2",
                                  "actor.mini_batch_size=16", "critic.mini_batch_size=15",
                                  "trainer.critic_warmup=3"]).batch
    gated = {t.source for t in plan.terms if t.gated_by_warmup}
    # generate, old_logprob and ref keep the actor group busy during warm-up: only the update is gated
    assert gated == {"update_actor: actor.mini_batch_size=16 x n=8"}
    assert plan.critic_warmup == 3
    # after warm-up: lcm(2, 128, 120) = 1920; 360 -> 1920
    assert (plan.multiple, plan.padded_batch, plan.pad_rows) == (1920, 1920, 1560)
    # during warm-up: lcm(2, 120) = 120; 360 = 3 x 120, no padding
    assert (plan.multiple_warmup, plan.padded_batch_warmup, plan.pad_rows_warmup) == (120, 360, 0)


def test_a_group_that_only_runs_the_gated_update_is_gated_too(ppo) -> None:
    ops = ppo.with_ops(stages.update_actor(group="learner")).ops
    p = Pipeline(ppo.name, ppo.source, ops, [*ppo.groups, WorkerGroup("learner", dp=3)], ppo.cluster, ppo.config,
                 ppo.outputs)
    plan = compile_pipeline(p, ["trainer.critic_warmup=2", *BIG]).batch
    # 8 x 4 = 32; minis 4 x 4 = 16; learner dp 3
    # after warm-up: lcm(1, 1, 1, 1, 3, 16, 16) = 48 -> 32 rounds up to 48
    assert (plan.multiple, plan.padded_batch, plan.pad_rows) == (48, 48, 16)
    # during warm-up neither the learner's dp nor the actor's mini-batch counts: lcm(1, 16) = 16 -> 32
    assert (plan.multiple_warmup, plan.padded_batch_warmup, plan.pad_rows_warmup) == (16, 32, 0)
    assert {t.source for t in plan.terms if t.gated_by_warmup} == {
        "dp of worker group 'learner'", "update_actor: actor.mini_batch_size=4 x n=4"}


def test_even_split_over_ranks(ppo) -> None:
    plan = compile_pipeline(ppo, ["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2",
                                  "actor.mini_batch_size=15", "critic.mini_batch_size=15", "rollout.micro_batch_size=16"])
    actor = plan.op("update_actor").batching
    # padded 360 over dp 2 = 180 per rank; 360 / 120 = 3 mini-batches of 120 = 60 per rank;
    # micro 8: ceil(60 / 8) = 8 micro-batches; 3 mini-batches x 1 epoch = 3 updates
    assert actor.dp == 2
    assert actor.samples_per_rank == 180
    assert (actor.mini_batch_samples, actor.mini_batches, actor.rank_mini_batch) == (120, 3, [60, 60])
    assert (actor.micro_batch_size, actor.micro_batches, actor.epochs, actor.updates_per_step) == (8, 8, 1, 3)
    critic = plan.op("update_critic").batching
    # dp 1: the whole mini-batch of 120 on one rank; ceil(120 / 8) = 15 micro-batches
    assert (critic.dp, critic.samples_per_rank, critic.rank_mini_batch) == (1, 360, [120, 120])
    assert critic.micro_batches == 15
    generate = plan.op("generate").batching
    # per-group op: its micro-batch counts prompts: 45 prompts + 0 padding rows over 2 ranks
    # = ceil(45 / 2) = 23 per rank, micro 16 prompts -> ceil(23 / 16) = 2 calls
    assert (generate.samples_per_rank, generate.micro_batch_size, generate.micro_batches) == (180, 16, 2)
    reward = plan.op("reward").batching
    # per-sample op on 1 rank: 360 samples, micro 64 -> ceil(360 / 64) = 6
    assert (reward.samples_per_rank, reward.micro_batch_size, reward.micro_batches) == (360, 64, 6)
    assert generate.mini_batches is None and generate.updates_per_step is None


def test_uneven_dp_share_is_recorded(ppo) -> None:
    plan = compile_pipeline(ppo, ["data.batch_size=10", "rollout.n=3", "groups.actor.dp=4",
                                  "actor.mini_batch_size=5", "critic.mini_batch_size=5", "actor.ppo_epochs=2",
                                  "actor.micro_batch_size=3", "old_logprob.micro_batch_size=4",
                                  "rollout.micro_batch_size=16", *BIG])
    actor = plan.op("update_actor").batching
    # padded 60 (see above); per rank 60 / 4 = 15; mini-batch 5 x 3 = 15 samples over 4 ranks:
    # 15 // 4 = 3 and ceil(15 / 4) = 4 -> shares [3, 4]; 60 / 15 = 4 mini-batches x 2 epochs = 8 updates;
    # micro 3: ceil(4 / 3) = 2 micro-batches on the rank with the larger share
    assert actor.samples_per_rank == 15
    assert (actor.mini_batch_samples, actor.mini_batches, actor.rank_mini_batch) == (15, 4, [3, 4])
    assert (actor.epochs, actor.updates_per_step, actor.micro_batches) == (2, 8, 2)
    # old_logprob on the actor's 4 ranks: 15 samples each, micro 4 -> ceil(15 / 4) = 4
    assert plan.op("old_logprob").batching.micro_batches == 4
    # values on the critic's single rank: 60 samples, micro 16 -> ceil(60 / 16) = 4
    values = plan.op("values").batching
    assert (values.dp, values.samples_per_rank, values.micro_batches) == (1, 60, 4)
    # generate: 10 prompts + 30 padding rows (each its own group) = 40 groups over 4 ranks = 10 per rank,
    # micro 16 prompts -> 1 call
    assert plan.op("generate").batching.micro_batches == 1
    # the advantage op declares no micro-batch
    adv = plan.op("advantage").batching
    assert (adv.samples_per_rank, adv.micro_batch_size, adv.micro_batches) == (60, None, None)


def test_generation_sized_by_a_token_budget_has_no_fixed_micro_batch_count(ppo) -> None:
    """rollout.micro_batch_size=0 (the default): the count depends on the prompts' lengths, known
    only when the call runs, so the plan does not claim one."""
    generate = compile_pipeline(ppo, ["data.batch_size=45", "rollout.n=8"]).op("generate").batching
    assert (generate.micro_batch_size, generate.micro_batches) == (0, None)


def test_op_batching_is_a_pure_function_of_the_graph(ppo) -> None:
    g = check(build(ppo))
    plan = batch(g)
    b = op_batching(g, g.spec("update_actor"), plan)
    # 8 x 4 = 32 samples, mini 4 x 4 = 16: 2 mini-batches of 16 on 1 rank, micro 8 -> 2 micro-batches
    assert (b.mini_batches, b.rank_mini_batch, b.micro_batches, b.updates_per_step) == (2, [16, 16], 2, 2)
    assert op_batching(g, g.spec("update_actor"), plan) == b


def test_grpo_padding(grpo) -> None:
    plan = compile_pipeline(grpo, ["data.batch_size=6", "rollout.n=5", "actor.mini_batch_size=4"]).batch
    # 6 x 5 = 30; terms dp 1 (actor, reward, advantage) and 4 x 5 = 20: m = 20; 30 rounds up to 40
    assert (plan.n, plan.global_batch, plan.multiple, plan.padded_batch, plan.pad_rows) == (5, 30, 20, 40, 10)


@op(outputs={"score": T.float32().metric()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


def test_without_a_generator_n_is_one() -> None:
    p = Pipeline("p", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers", dp=3)],
                 config={"data": {"batch_size": 5}})
    g = check(build(p))
    assert group_size(g) == 1
    plan = batch(g)
    # 5 x 1 = 5 samples; the only term is dp 3 -> m = 3; 5 rounds up to 6
    assert (plan.global_batch, plan.multiple, plan.padded_batch) == (5, 3, 6)
