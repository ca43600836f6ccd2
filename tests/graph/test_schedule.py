"""Pass 5, schedule: stream/group/barrier modes, stages, what may overlap, the critical path.

Costs of the built-in stages (their ``cost`` hints): generate 5, reward 0.5, old_logprob 1,
ref 1, values 1, advantage 0.2, update_critic 3, update_actor 3.
"""

from __future__ import annotations

import pytest

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op
from rlgraph.graph.build import build
from rlgraph.graph.check import check
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.schedule import concurrency, mode_of, schedule
from rlgraph.ops import stages


@pytest.mark.parametrize("granularity, mode", [("sample", "stream"), ("group", "group"), ("batch", "barrier")])
def test_mode_follows_granularity(granularity, mode) -> None:
    assert mode_of(granularity) == mode


def test_ppo_modes(ppo) -> None:
    plan = compile_pipeline(ppo).schedule
    assert plan.streaming == ["old_logprob", "ref", "reward", "values"]
    assert plan.group_wise == ["generate"]
    assert plan.barriers == ["advantage", "update_actor", "update_critic"]  # GAE whitens the batch


def test_grpo_advantage_is_group_wise(grpo) -> None:
    plan = compile_pipeline(grpo)
    assert plan.schedule.group_wise == ["advantage", "generate"]
    assert plan.op("advantage").mode == "group"
    assert plan.schedule.barriers == ["update_actor"]


def test_ppo_stages_are_topological_generations(ppo) -> None:
    sched, stage_of, _ = schedule(check(build(ppo)))
    assert sched.stages == [
        ["generate"],  # reads only the source (and last step's policy weights)
        ["old_logprob", "ref", "reward", "values"],  # read generate's output
        ["advantage"],  # reads scores, values, log-probs
        ["update_actor", "update_critic"],  # read advantages / returns
    ]
    assert stage_of == {"generate": 0, "old_logprob": 1, "ref": 1, "reward": 1, "values": 1, "advantage": 2,
                        "update_actor": 3, "update_critic": 3}


def test_ppo_concurrency(ppo) -> None:
    conc = concurrency(check(build(ppo)))
    # reward (own pool) overlaps every forward pass; values (critic pool) overlaps reward and the actor's passes
    assert conc["reward"] == ["old_logprob", "ref", "values"]
    assert "values" in conc["reward"] and "reward" in conc["values"]
    # old_logprob and ref run on the same actor workers: independent, but they cannot overlap
    assert conc["old_logprob"] == ["reward", "values"]
    assert "ref" not in conc["old_logprob"] and "old_logprob" not in conc["ref"]
    assert conc["values"] == ["old_logprob", "ref", "reward"]
    # the two updates do not depend on each other and sit on different pools
    assert conc["update_actor"] == ["update_critic"]
    # everything depends on generate, and advantage sits between the forward passes and the updates
    assert conc["generate"] == [] and conc["advantage"] == []
    for a, others in conc.items():  # symmetric
        for b in others:
            assert a in conc[b]


def test_sharing_a_pool_removes_overlap(ppo) -> None:
    plan = compile_pipeline(ppo, ["groups.reward.pool=critic"])
    # reward and values now time-share the critic pool's workers
    assert plan.op("reward").concurrent_with == ["old_logprob", "ref"]
    assert plan.op("values").concurrent_with == ["old_logprob", "ref"]


def test_grpo_critical_path_runs_from_data_to_update_actor(grpo) -> None:
    sched = compile_pipeline(grpo).schedule
    path = sched.critical_path
    # GRPO's advantage reads only rewards (no KL in the reward), so the forward passes feed
    # update_actor directly: data -> generate 5 -> old_logprob or ref 1 -> update_actor 3 = 9.0
    # (through reward and advantage instead: 5 + 0.5 + 0.2 + 3 = 8.7)
    assert path[0] == "data" and path[-1] == "update_actor"
    assert path[:2] == ["data", "generate"] and path[3:] == ["update_actor"]
    assert path[2] in ("old_logprob", "ref")
    assert sched.critical_path_cost == pytest.approx(9.0)


def test_ppo_critical_path(ppo) -> None:
    sched = compile_pipeline(ppo).schedule
    # generate 5 + one forward pass 1 + advantage 0.2 + an update 3 = 9.2 (both updates cost 3)
    assert sched.critical_path[0] == "data"
    assert sched.critical_path[-1] in ("update_actor", "update_critic")
    assert sched.critical_path_cost == pytest.approx(9.2)
    # a cheaper critic update leaves update_actor alone at the end: 9.2 vs 5 + 1 + 0.2 + 1 = 7.2
    cheap = compile_pipeline(ppo.with_ops(stages.update_critic(cost=1.0))).schedule
    assert cheap.critical_path[0] == "data" and cheap.critical_path[-1] == "update_actor"
    assert cheap.critical_path_cost == pytest.approx(9.2)


@op(outputs={"a_out": T.float32()}, group="w", cost=2.0)
def a(x: T.float32()):
    return x


@op(outputs={"b_out": T.float32()}, group="w", cost=1.0)
def b(x: T.float32()):
    return x


@op(outputs={"c_out": T.float32()}, group="w", granularity="batch", cost=4.0)
def c(a_out: T.float32(), b_out: T.float32()):
    return a_out


@op(outputs={"d_metrics": T.json().metric()}, group="w", granularity="batch", cost=0.5)
def d(c_out: T.float32()):
    return {}


def test_critical_path_takes_the_most_expensive_branch() -> None:
    p = Pipeline("diamond", DataSource({"x": T.float32()}), [a, b, c, d], [WorkerGroup("w")])
    sched, stage_of, conc = schedule(check(build(p)))
    # data -> a 2 -> c 4 -> d 0.5 = 6.5 beats data -> b 1 -> c 4 -> d 0.5 = 5.5
    assert sched.critical_path == ["data", "a", "c", "d"]
    assert sched.critical_path_cost == pytest.approx(6.5)
    assert sched.stages == [["a", "b"], ["c"], ["d"]]
    assert conc["a"] == []  # a and b are independent but share group 'w'
    assert sched.streaming == ["a", "b"] and sched.barriers == ["c", "d"]
