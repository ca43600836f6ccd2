"""examples/ppo_rm.py (PPO with a rule + reward-model reward) on Ray and TransferQueue, two steps,
with the reward model on its own pool and colocated with the policy (``groups.rm.pool=actor``).

The tiny policy and a tiny, briefly trained reward model are built once per module in a temp
directory (a few seconds), not in the examples' cache: the test checks the wiring, not how good
the reward model is.
"""

import math
from pathlib import Path

import pytest

import rlgraph
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.runner import RunOptions, run_plan

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "ppo_rm.py")
COMBINED = "combine_rewards/combine_rewards_metrics"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rlgraph.ops.reward.model import prepare_tiny_reward_model
    from rlgraph.ops.tiny import prepare_tiny_policy

    root = tmp_path_factory.mktemp("ppo_rm")
    policy = prepare_tiny_policy(str(root / "policy"), "add", sft_steps=30)
    rm = prepare_tiny_reward_model(root / "rm", "add", steps=20, sft_steps=20)
    return str(policy), str(rm)


def _plan(models, *extra):
    pipeline, ref = load_pipeline(EXAMPLE)
    policy, rm = models
    small = [f"actor.model_path={policy}", f"reward_model.model_path={rm}", "data.batch_size=4", "rollout.n=4",
             "actor.mini_batch_size=4", "critic.mini_batch_size=4", "data.num_rows=64", "trainer.save_every=0",
             *extra]
    return rlgraph.compile(pipeline, small, pipeline_ref=ref)


def test_layouts_compile():
    pipeline, ref = load_pipeline(EXAMPLE)
    own = rlgraph.compile(pipeline, [], pipeline_ref=ref)
    assert own.group("rm").pool == "rm" and own.group("actor").pool == "actor"
    assert {p.name: p.groups for p in own.pools}["rm"] == ["rm"]
    shared = rlgraph.compile(pipeline, ["groups.rm.pool=actor"], pipeline_ref=ref)
    pools = {p.name: p for p in shared.pools}
    assert "rm" not in pools and sorted(pools["actor"].groups) == ["actor", "rm"]
    assert shared.group("rm").pool == "actor"
    # the colocated pool's bundles are time-shared: no more CPUs than the actor alone asks for
    assert sum(b.num_cpus for b in pools["actor"].bundles) == shared.group("actor").num_cpus


@pytest.mark.parametrize("layout", ["own_pool", "colocated"])
def test_mixed_reward_trains(layout, models, tq_plane, tmp_path):
    plan = _plan(models, *(["groups.rm.pool=actor"] if layout == "colocated" else []))
    assert plan.group("rm").pool == ("actor" if layout == "colocated" else "rm")
    records = run_plan(plan, RunOptions(out_dir=tmp_path, steps=2, timeout_s=300), plane=tq_plane)
    assert len(records) == 2
    for rec in records:
        rule, rm = rec[f"{COMBINED}/rule_scores/mean"], rec[f"{COMBINED}/rm_scores/mean"]
        assert 0.0 <= rule <= 1.0 and math.isfinite(rm), (rule, rm)
        assert rec[f"{COMBINED}/rm_scores/weight"] == 0.5 and rec[f"{COMBINED}/rule_scores/weight"] == 1.0
        # the combined score is the weighted sum of the sources' means (each on one token per sample)
        assert rec["score/mean"] == pytest.approx(rule + 0.5 * rm, abs=1e-4)
        assert rec["rule_reward/rule_reward_metrics/scored_count"] == 16
        assert rec["samples/real"] == 16 and rec["driver/payload_bytes"] == 0
        assert math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert math.isfinite(rec["update_critic/critic_metrics/vf_loss"])
