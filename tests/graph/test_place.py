"""Pass 6, place: groups onto pools, pools onto nodes (first fit, largest first), data-plane CPUs.

PPO's groups (examples/ppo.py): actor, critic, reward with 1 CPU per worker, advantage with 0.5;
dp=1 each; one node of 8 CPUs. TransferQueue reserves cpus_per_unit x (1 controller + units).
"""

from __future__ import annotations

import pytest

from rlgraph import PipelineError
from rlgraph.graph.build import build
from rlgraph.graph.check import check
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.packing import dataplane_cpus
from rlgraph.graph.place import place, resource_problems


def _nodes(plan) -> dict[str, list[int]]:
    return {p.name: [b.node for b in p.bundles] for p in plan.pools}


def test_ppo_places_one_bundle_per_group_on_one_node(ppo) -> None:
    plan = compile_pipeline(ppo)
    assert [p.name for p in plan.pools] == ["actor", "critic", "reward", "advantage"]
    assert _nodes(plan) == {"actor": [0], "critic": [0], "reward": [0], "advantage": [0]}
    # data plane 1 x (1 + 1) = 2; workers 1 + 1 + 1 + 0.5 = 3.5; total 5.5
    assert plan.cluster.dataplane_cpus == 2.0
    assert plan.cluster.required_cpus == 5.5
    assert plan.cluster.required_gpus == 0.0
    assert plan.group("actor").ops == ["generate", "old_logprob", "ref", "update_actor"]


def test_colocated_groups_share_the_bundles_of_one_pool(ppo) -> None:
    plan = compile_pipeline(ppo, ["groups.critic.pool=actor", "groups.critic.dp=3", "groups.critic.num_cpus=2",
                                  "groups.actor.dp=2", "cluster.cpus_per_node=16"])
    pools = {p.name: p for p in plan.pools}
    assert list(pools) == ["actor", "reward", "advantage"]
    shared = pools["actor"]
    assert shared.groups == ["actor", "critic"]
    # pool size = max(dp) = max(2, 3) = 3 bundles, each max(1, 2) = 2 CPUs
    assert [(b.index, b.num_cpus) for b in shared.bundles] == [(0, 2.0), (1, 2.0), (2, 2.0)]
    assert plan.group("critic").pool == "actor"
    # data plane 2 + shared 3 x 2 + reward 1 + advantage 0.5 = 9.5
    assert plan.cluster.required_cpus == 9.5


def test_colocated_reward_model_rides_on_the_actor_gpus(ppo) -> None:
    plan = compile_pipeline(ppo, ["cluster.gpus_per_node=2", "groups.actor.num_gpus=1", "groups.actor.dp=2",
                                  "groups.reward.pool=actor"])
    shared = {p.name: p for p in plan.pools}["actor"]
    # reward (dp 1, no GPU) time-shares the actor's 2 one-GPU bundles: no extra bundle, no extra GPU
    assert shared.groups == ["actor", "reward"]
    assert [(b.num_cpus, b.num_gpus) for b in shared.bundles] == [(1.0, 1.0), (1.0, 1.0)]
    assert plan.cluster.required_gpus == 2.0


@pytest.mark.parametrize(
    "overrides, cpus",
    [
        ([], 2.0),  # 1 CPU x (1 controller + 1 unit)
        (["dataplane.storage_units=3"], 4.0),  # 1 x (1 + 3)
        (["dataplane.storage_units=3", "dataplane.cpus_per_unit=0.5"], 2.0),  # 0.5 x (1 + 3)
        (["dataplane.backend=ray"], 0.0),  # Ray's object store reserves no CPUs
    ],
)
def test_data_plane_cpus_are_reserved(ppo, overrides, cpus) -> None:
    plan = compile_pipeline(ppo, overrides)
    assert plan.cluster.dataplane_cpus == cpus
    assert dataplane_cpus(build(ppo, overrides).config) == cpus
    # workers 1 + 1 + 1 + 0.5 = 3.5 on top
    assert plan.cluster.required_cpus == cpus + 3.5


def test_data_plane_reservation_is_taken_from_node_0_first(ppo) -> None:
    two_small = ["cluster.num_nodes=2", "cluster.cpus_per_node=3",
                 "dataplane.storage_units=1"]
    # node 0 keeps 3 - 2 = 1 CPU after the data plane (controller and the one unit); bundles largest first, then by pool name:
    # actor 1 -> node 0 (0 left); critic 1 -> node 1 (2 left); reward 1 -> node 1 (1 left);
    # advantage 0.5 -> node 1 (0.5 left)
    assert _nodes(compile_pipeline(ppo, two_small)) == {"actor": [0], "critic": [1], "reward": [1],
                                                        "advantage": [1]}
    # without the reservation node 0 takes actor, critic and reward (3 CPUs); advantage goes to node 1
    assert _nodes(compile_pipeline(ppo, [*two_small, "dataplane.backend=ray"])) == {
        "actor": [0], "critic": [0], "reward": [0], "advantage": [1]}


def test_one_storage_unit_per_node_by_default(ppo) -> None:
    assert compile_pipeline(ppo, []).config["dataplane"]["storage_units"] == 1
    plan = compile_pipeline(ppo, ["cluster.num_nodes=3", "cluster.cpus_per_node=4"])
    assert plan.config["dataplane"]["storage_units"] == 3
    assert plan.cluster.dataplane_cpus == 4  # the controller and three units
    assert compile_pipeline(ppo, ["cluster.num_nodes=3", "dataplane.storage_units=2"]).config[
        "dataplane"]["storage_units"] == 2


def test_multi_node_packing_first_fit_largest_first(ppo) -> None:
    plan = compile_pipeline(ppo, ["cluster.num_nodes=2", "cluster.cpus_per_node=5", "groups.actor.dp=2",
                                  "groups.actor.num_cpus=2"])
    # free CPUs [5 - 2 = 3, 5]; order: actor[0] 2, actor[1] 2, critic 1, reward 1, advantage 0.5
    # actor[0] -> node 0 (1 left); actor[1] -> node 1 (3 left); critic -> node 0 (0 left);
    # reward -> node 1 (2 left); advantage -> node 1 (1.5 left)
    assert _nodes(plan) == {"actor": [0, 1], "critic": [0], "reward": [1], "advantage": [1]}
    assert [b.index for b in plan.pools[0].bundles] == [0, 1]


def test_gpu_bundles_are_packed_first(ppo) -> None:
    plan = compile_pipeline(ppo, ["cluster.num_nodes=2", "cluster.gpus_per_node=2", "groups.actor.dp=3",
                                  "groups.actor.num_gpus=1", "groups.critic.num_gpus=1"])
    # GPU bundles first: actor[0], actor[1] -> node 0 (its 2 GPUs); actor[2], critic[0] -> node 1;
    # then the CPU-only reward and advantage -> node 0 (8 - 2 data plane - 2 actor = 4 CPUs left)
    assert _nodes(plan) == {"actor": [0, 0, 1], "critic": [1], "reward": [0], "advantage": [0]}
    assert plan.cluster.required_gpus == 4.0  # 3 x 1 + 1


def test_place_is_pure(ppo) -> None:
    g = check(build(ppo))
    assert resource_problems(g) == []
    groups, pools, cluster = place(g)
    assert place(g) == (groups, pools, cluster)
    assert [gp.name for gp in groups] == ["actor", "critic", "reward", "advantage"]
    assert cluster.num_nodes == 1 and cluster.cpus_per_node == 8.0


def test_spread_pool_goes_round_robin_over_the_nodes(ppo) -> None:
    over = ["cluster.num_nodes=3", "groups.reward.dp=4", "groups.reward.num_cpus=0.5"]
    packed = compile_pipeline(ppo, over)
    assert _nodes(packed)["reward"] == [0, 0, 0, 0]
    spread = compile_pipeline(ppo, over + ["groups.reward.placement=spread"])
    assert _nodes(spread)["reward"] == [0, 1, 2, 0]
    assert _nodes(spread)["actor"] == [0]  # other pools still packed


def test_strict_spread_puts_each_worker_on_a_node_of_its_own(ppo) -> None:
    over = ["cluster.num_nodes=3", "groups.reward.num_cpus=0.5", "groups.reward.placement=strict_spread"]
    plan = compile_pipeline(ppo, over + ["groups.reward.dp=3"])
    assert _nodes(plan)["reward"] == [0, 1, 2]
    assert next(p for p in plan.pools if p.name == "reward").placement == "strict_spread"
    with pytest.raises(PipelineError, match=r"pool 'reward' slot 3 .* do not fit|1 worker slot\(s\) do not fit"):
        compile_pipeline(ppo, over + ["groups.reward.dp=4"])  # 4 workers, 3 nodes: one would share a node


def test_a_pool_takes_the_most_spread_placement_of_its_groups(ppo) -> None:
    plan = compile_pipeline(ppo, ["cluster.num_nodes=2", "groups.critic.pool=reward",
                                  "groups.critic.placement=strict_spread", "groups.reward.placement=spread"])
    assert next(p for p in plan.pools if p.name == "reward").placement == "strict_spread"


def test_torch_threads_follow_the_cpus_of_the_bundle(ppo) -> None:
    plan = compile_pipeline(ppo)
    # 1 CPU per worker -> 1 thread; advantage's 0.5 CPU still computes on 1
    assert {g.name: g.torch_threads for g in plan.groups} == {"actor": 1, "critic": 1, "reward": 1, "advantage": 1}
    shared = compile_pipeline(ppo, ["groups.critic.pool=actor", "groups.critic.num_cpus=2.5", "groups.actor.num_cpus=4",
                                    "groups.reward.torch_threads=3", "cluster.cpus_per_node=16"])
    # colocated groups take turns on a bundle of max(4, 2.5) CPUs, so each may use all of it
    assert {g.name: g.torch_threads for g in shared.groups} == {"actor": 4, "critic": 4, "reward": 3, "advantage": 1}


def test_a_worker_sets_its_torch_threads_capped_at_its_cores(ppo, monkeypatch) -> None:
    import os

    import torch

    from rlgraph.runtime.worker import torch_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    try:
        assert torch_threads(1) == 1 and torch.get_num_threads() == 1
        assert torch_threads(8) == 2 and torch.get_num_threads() == 2  # two cores to use
    finally:
        torch.set_num_threads(before)


def _lent(plan) -> dict[str, int]:
    return {o.name: o.torch_threads for o in plan.ops if o.torch_threads}


def test_an_op_that_runs_alone_on_its_node_computes_on_the_idle_groups_cpus(grpo, ppo) -> None:
    plan = compile_pipeline(grpo)
    groups = {g.name: g for g in plan.groups}
    assert set(groups) == {"actor", "reward"} and groups["actor"].torch_threads == 1
    # the update is a barrier with nothing concurrent: the reward group's CPU is idle meanwhile
    assert _lent(plan) == {"update_actor": 2}
    # a user's threads are kept
    assert _lent(compile_pipeline(grpo, ["groups.actor.torch_threads=1"])) == {}
    # with a step in flight ahead (grpo_async's rollout group), the next step's rollout may run during
    # the update; on-policy, the same graph lends the update the rollout group's idle CPU
    from rlgraph.graph.loader import load_pipeline

    from .conftest import REPO

    asynchronous = load_pipeline(str(REPO / "examples" / "grpo_async.py"))[0]
    assert _lent(compile_pipeline(asynchronous)) == {}
    assert _lent(compile_pipeline(asynchronous, ["trainer.max_staleness=0"])) == {"update_actor": 2}
    # the idle CPUs are shared by the op's ranks on the node: 1 CPU over 2 ranks lends none, 3 lend 1 each
    assert _lent(compile_pipeline(grpo, ["groups.actor.dp=2"])) == {}
    assert _lent(compile_pipeline(grpo, ["groups.actor.dp=2", "groups.reward.num_cpus=3"])) == {"update_actor": 2}
    # colocated groups may run on the op's own pool's other bundles: only other pools lend
    assert _lent(compile_pipeline(grpo, ["groups.reward.pool=actor"])) == {}
    # lending needs one node (a cluster's placement is Ray's, best effort)
    assert _lent(compile_pipeline(grpo, ["cluster.num_nodes=2"])) == {}
    # PPO: the two updates overlap each other, so neither borrows; GAE's advantage writes no state,
    # so nothing of the next step (admitted while this one runs) is known to wait for it
    assert _lent(compile_pipeline(ppo)) == {}


def test_a_worker_computes_an_op_with_its_lent_threads_and_goes_back_after(monkeypatch) -> None:
    import os
    from types import SimpleNamespace

    import torch

    from rlgraph.runtime.worker import GroupWorker, torch_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    worker = SimpleNamespace(torch_threads=torch_threads(1))
    try:
        with GroupWorker._threads(worker, SimpleNamespace(torch_threads=4)):
            assert torch.get_num_threads() == 2  # capped at the process's cores
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), GroupWorker._threads(worker, SimpleNamespace(torch_threads=2)):
            raise RuntimeError("the body failed")
        assert torch.get_num_threads() == 1  # also after a failure
        with GroupWorker._threads(worker, SimpleNamespace(torch_threads=0)):  # the group's own
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
