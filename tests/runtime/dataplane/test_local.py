"""A worker's own columns (`LocalColumns`, `local_columns`): read back as the plane would return them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.rows import Rows
from rlgraph.runtime.dataplane.local import LocalColumns
from rlgraph.runtime.worker import local_columns

ROOT = Path(__file__).parents[3]


def test_values_come_back_as_a_plane_get_returns_them():
    local = LocalColumns()
    local.keep("p", [4, 5, 6], {"dense": torch.arange(6).view(3, 2),
                                "ragged": [torch.ones(1), torch.ones(3), torch.ones(2)],
                                "same": [torch.zeros(2), torch.ones(2), torch.ones(2)],
                                "text": ["a", "b", "c"], "info": [{"k": 1}, {"k": 2}, {"k": 3}]})
    got = local.take("p", [6, 4], ["dense", "ragged", "same", "text", "info"])
    assert torch.equal(got["dense"], torch.tensor([[4, 5], [0, 1]]))
    assert [t.tolist() for t in got["ragged"]] == [[1.0, 1.0], [1.0]]  # ragged rows stay a list
    assert isinstance(got["same"], torch.Tensor) and got["same"].shape == (2, 2)  # rows of one shape: dense
    assert got["text"] == ["c", "a"]
    got["info"][0]["k"] = 99  # a body changing what it was given changes nothing kept
    assert local.take("p", [6], ["info"])["info"] == [{"k": 3}]
    kept = Rows(torch.arange(4), [1, 3])  # ragged rows of one tensor, read whole: as they are (padded once)
    local.keep("q", [0, 1], {"r": kept})
    assert local.take("q", [0, 1], ["r"])["r"] is kept
    assert [t.tolist() for t in local.take("q", [1], ["r"])["r"]] == [[1, 2, 3]]  # some rows: a plain get


def test_only_columns_held_for_every_row_are_served():
    local = LocalColumns()
    local.keep("p", [0, 1], {"a": torch.zeros(2), "b": torch.ones(2)})
    local.keep("p", [2], {"a": torch.zeros(1)})
    assert set(local.take("p", [0, 1, 2], ["a", "b", "c"])) == {"a"}  # b lacks row 2, c was never kept
    assert local.take("q", [0], ["a"]) == {}
    local.forget("p")
    assert local.take("p", [0], ["a"]) == {} and local.partitions() == []


def test_rows_from_several_keeps_come_back_in_order_with_the_last_value_of_each():
    local = LocalColumns()
    local.keep("p", [0, 1, 2, 3], {"x": torch.arange(8.0).view(4, 2), "t": ["a", "b", "c", "d"]})
    local.keep("p", [4, 5], {"x": torch.full((2, 2), -1.0), "t": ["e", "f"]})
    local.keep("p", [1], {"x": torch.full((1, 2), 9.0), "t": ["B"]})  # row 1 again (a call run twice)
    got = local.take("p", [5, 1, 0, 4], ["x", "t"])
    assert torch.equal(got["x"], torch.tensor([[-1.0, -1.0], [9.0, 9.0], [0.0, 1.0], [-1.0, -1.0]]))
    assert got["t"] == ["f", "B", "a", "e"]
    whole = local.take("p", [1], ["x"])["x"]  # one keep read whole: a copy, as a get's
    whole.add_(100)
    assert torch.equal(local.take("p", [1], ["x"])["x"], torch.full((1, 2), 9.0))
    assert local.take("p", [0, 6], ["x"]) == {}  # row 6 was never kept here: read it from the plane


def _grpo(*overrides, reward_group: bool = True):
    """examples/grpo_reward_pool.py compiled (another group reads what the actor writes), or, without
    `reward_group`, examples/grpo.py (every op on the actor's group)."""
    example = "grpo_reward_pool.py" if reward_group else "grpo.py"
    pipeline, _ = load_pipeline(str(ROOT / "examples" / example))
    return compile(pipeline, list(overrides))


def test_the_actor_keeps_what_its_own_ops_read_and_shares_what_others_read():
    kept, private = local_columns(_grpo(), "actor")
    # ref and update_actor read generate's outputs on the actor
    assert {"responses", "response_mask", "input_ids", "attention_mask", "position_ids", "ref_log_prob"} <= kept
    # read by the actor's ops alone (one rank, a stateful group): never sent to the data plane
    assert private == {"input_ids", "attention_mask", "position_ids", "ref_log_prob", "policy_version",
                       "policy_version_end"}
    assert "responses" not in private and "response_mask" not in private  # reward and advantage read them
    # the advantage reads the scores on the reward's worker, inside the reward's calls: kept there and never
    # sent (the step's score/mean and validation come from each row's sum in the call's result)
    assert local_columns(_grpo(), "reward") == (frozenset({"token_level_scores"}), frozenset({"token_level_scores"}))


@pytest.mark.parametrize("overrides", [["groups.actor.dp=2", "data.batch_size=16"]])
def test_nothing_is_private_when_another_rank_may_read_it(overrides):
    kept, private = local_columns(_grpo(*overrides), "actor")
    assert "ref_log_prob" in kept and private == frozenset()


def test_with_every_op_on_the_actor_no_column_of_the_step_reaches_the_plane():
    # examples/grpo.py as it is: the reward, the reference and the advantage ride in generation's calls and the
    # update runs on the same single rank; the summaries (score, response_length) travel as each row's sum
    kept, private = local_columns(_grpo(reward_group=False), "actor")
    assert kept == private and {"responses", "response_mask", "token_level_scores", "advantages",
                                "ref_log_prob"} <= private
    # two ranks: a column read only inside the chain that writes it stays private (its readers run in the
    # writer's call, on its rows); what the update reads may be on the other rank
    kept, private = local_columns(_grpo("groups.actor.dp=2", "data.batch_size=16", reward_group=False), "actor")
    assert private == {"token_level_scores"} and "advantages" in kept


def test_nothing_is_private_with_dynamic_sampling():
    pipeline, _ = load_pipeline(str(ROOT / "examples" / "dapo.py"))
    kept, private = local_columns(compile(pipeline, []), "actor")
    assert kept and private == frozenset()  # kept rows are copied between partitions through the plane


def test_generation_reads_ahead_the_source_columns_it_and_its_fused_ops_read():
    from rlgraph.runtime.worker import read_ahead_ops

    plan = _grpo(reward_group=False)
    assert plan.op("reward").fused_into == "generate"
    # generation reads only the source's prompts; the reward and the advantage, fused into its calls, read the
    # source's answers and group ids: one read of all of them
    assert read_ahead_ops(plan) == {"generate": ("prompt_ids", "data_source", "ground_truth", "extra_info",
                                                 "uid", "is_padding")}
    assert read_ahead_ops(_grpo()) == {"generate": ("prompt_ids",)}  # the reward reads on its own group
    assert read_ahead_ops(_grpo("groups.actor.dp=2", "data.batch_size=16", reward_group=False)) == {}
    pipeline, _ = load_pipeline(str(ROOT / "examples" / "dapo.py"))
    assert read_ahead_ops(compile(pipeline, [])) == {}  # dynamic sampling assembles its batches from rounds


def test_a_read_ahead_hands_each_row_of_a_column_out_once_as_a_get_of_those_rows_would():
    from rlgraph.runtime.worker import _ReadAhead

    ragged = [torch.ones(2), torch.ones(3), torch.ones(2), torch.ones(2)]
    ahead = _ReadAhead((0, 1, 2, 3), values={"dense": torch.arange(8).view(4, 2), "ragged": ragged,
                                              "text": ["a", "b", "c", "d"]})
    first = ahead.take((2, 3), ["dense", "ragged", "text", "absent"])
    assert torch.equal(first["dense"], torch.tensor([[4, 5], [6, 7]]))
    assert torch.equal(first["ragged"], torch.ones(2, 2))  # rows of one shape: dense, as the plane's get gives
    assert first["text"] == ["c", "d"] and "absent" not in first
    assert ahead.take((3,), ["dense"]) == {}  # handed out already: a retried call reads from the plane
    assert ahead.take((4,), ["dense"]) == {}  # a row it did not read
    assert not ahead.used_up
    rest = ahead.take((0, 1), ["dense", "ragged", "text"])
    assert [len(r) for r in rest["ragged"]] == [2, 3] and rest["text"] == ["a", "b"]
    assert ahead.used_up
    whole = _ReadAhead((0, 1), values={"text": ["x", "y"]})
    assert whole.take((0, 1), ["text"])["text"] is whole.values["text"]  # all its rows: the value as read
