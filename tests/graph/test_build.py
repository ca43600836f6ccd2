"""Pass 1, build: config resolution and the column graph (one node per op, one edge per column)."""

from __future__ import annotations

import networkx as nx
import pytest

from rlgraph import DataSource, Pipeline, T, WorkerGroup, op
from rlgraph.errors import ConfigError
from rlgraph.graph.build import build, config_schema
from rlgraph.graph.check import check

PPO_OPS = ["generate", "reward", "old_logprob", "ref", "values", "advantage", "update_critic", "update_actor"]


@op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str(), *, scale: float = 1.0):
    return scale


@op(outputs={"score": T.float32()}, group="workers")
def judge_again(prompt: T.str()):
    return 0.0


@op(outputs={"total": T.float32().metric()}, group="workers", granularity="batch")
def total(score: T.float32(), missing: T.float32()):
    return 0.0


def test_one_node_per_op_plus_the_source(ppo) -> None:
    g = build(ppo)
    assert set(g.dag.nodes) == {"data", *PPO_OPS}
    assert g.dag.number_of_nodes() == 1 + 8
    assert g.dag.nodes["data"]["kind"] == "source"
    assert all(g.dag.nodes[name]["kind"] == "op" for name in PPO_OPS)
    assert g.spec("update_actor").config_key == "actor"


def test_one_edge_per_column_per_consumer(ppo) -> None:
    g = build(ppo)
    # Inputs of each PPO op, all produced by exactly one node:
    #   generate 2 (prompt_ids, policy_weights)
    # + reward 5 (responses, response_mask, data_source, ground_truth, extra_info)
    # + old_logprob 7 (input_ids, attention_mask, position_ids, responses, response_mask, policy_weights,
    #   and its optional rollout_log_probs: old_logprob.compare_rollout is true by default)
    # + ref 5 (the model inputs and response_mask)
    # + values 6 (the 5 model inputs + critic_weights)
    # + advantage 7 (token_level_scores, response_mask, uid, is_padding, values, old_log_probs, ref_log_prob)
    # + update_critic 7 (4 model inputs, response_mask, values, returns)
    # + update_actor 9 (4 model inputs, response_mask, old_log_probs, advantages, and its optional
    #   policy_version and policy_version_end, always read for the staleness guard and metrics; its
    #   optional ref_log_prob and
    #   rollout_log_probs are not connected: actor.use_kl_loss is false, the KL is in the reward,
    #   and actor.tis_cap and actor.decoupled_cap are 0)
    # = 2 + 5 + 7 + 5 + 6 + 7 + 7 + 9 = 48
    assert g.dag.number_of_edges() == 48
    # generate -> reward carries responses and response_mask: two edges keyed by column
    assert set(g.dag.get_edge_data("generate", "reward")) == {"responses", "response_mask"}
    for u, v, key, attrs in g.dag.edges(keys=True, data=True):
        assert key == attrs["column"]
        assert attrs["column"] in g.spec(v).inputs
        assert u in g.producers[attrs["column"]]


def test_policy_weights_are_a_state_edge_and_not_a_cycle(ppo) -> None:
    g = build(ppo)
    edge = g.dag.get_edge_data("update_actor", "generate")
    assert edge == {"policy_weights": {"column": "policy_weights", "kind": "state"}}
    assert g.dag.get_edge_data("update_critic", "values")["critic_weights"]["kind"] == "state"
    state = sorted((u, v, c) for u, v, c, kind in g.dag.edges(keys=True, data="kind") if kind == "state")
    assert state == [
        ("update_actor", "generate", "policy_weights"),
        ("update_actor", "old_logprob", "policy_weights"),
        ("update_critic", "values", "critic_weights"),
    ]
    # With its state edges the graph loops back (step t feeds step t+1) ...
    assert not nx.is_directed_acyclic_graph(g.dag)
    # ... but the data edges alone are acyclic, and the checker finds no cycle.
    d = g.data_dag
    assert nx.is_directed_acyclic_graph(d)
    assert not d.has_edge("update_actor", "generate")
    assert check(g) is g


def test_config_layers_defaults_then_pipeline_config_then_overrides(ppo) -> None:
    g = build(ppo, ["actor.lr=0.5", "groups.actor.dp=2"])
    assert g.config["actor.clip_ratio_low"] == 0.2  # stage default
    assert g.config["critic.lr"] == 1e-4  # examples/ppo.py config replaces the default 1e-5
    assert g.config["actor.lr"] == 0.5  # the override replaces the pipeline's 1e-4
    assert g.config["groups.actor.dp"] == 2
    assert g.config["data.batch_size"] == 8
    assert g.overrides == {"actor.lr": "0.5", "groups.actor.dp": "2"}
    assert g.param(g.spec("update_actor"), "lr") == 0.5
    assert set(g.config) == set(g.schema)
    assert g.problems == ()


def test_overrides_may_be_a_mapping(ppo) -> None:
    assert build(ppo, {"rollout.n": "2"}).config["rollout.n"] == 2


def test_malformed_override_raises_while_building(ppo) -> None:
    with pytest.raises(ConfigError, match=r"'rollout\.n' is not of the form key=value"):
        build(ppo, ["rollout.n"])


def test_schema_namespaces(ppo) -> None:
    schema, problems = config_schema(ppo)
    assert problems == []
    namespaces = {k.split(".")[0] for k in schema}
    assert namespaces == {"data", "trainer", "dataplane", "cluster", "groups", "rollout", "reward", "old_logprob",
                          "ref", "values", "algorithm", "critic", "actor"}
    assert {"groups.actor.dp", "groups.actor.pool", "groups.critic.num_gpus"} <= set(schema)


def test_build_records_problems_instead_of_raising() -> None:
    p = Pipeline("p", DataSource({"prompt": T.str()}), [judge, judge_again, total], [WorkerGroup("workers")],
                 config={"judge": {"scael": 2.0}})
    g = build(p, ["judge.scale=x"])
    assert [x.code for x in g.problems] == ["config-unknown-key", "config-type"]
    assert g.producers["score"] == ("judge", "judge_again")
    assert "missing" not in g.producers
    # both producers of 'score' get an edge to its consumer; the unproduced 'missing' gets none
    assert set(g.dag.in_edges("total", keys=True)) == {("judge", "total", "score"), ("judge_again", "total", "score")}
    assert g.producers["uid"] == ("data",) and g.producers["is_padding"] == ("data",)
