"""Dynamic sampling's refill in the compiler: the rounds' ops, the carried columns, the checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import rlgraph
from rlgraph import T, op
from rlgraph.graph.dsl import op_spec
from rlgraph.errors import PipelineError
from rlgraph.graph.loader import load_pipeline
from rlgraph.graph.viz import dot_source
from rlgraph.ops import stages

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def dapo():
    return load_pipeline(str(ROOT / "examples" / "dapo.py"))[0]


def _codes(err: PipelineError) -> list[str]:
    return [p.code for p in err.problems]


def test_the_rounds_are_the_filter_and_everything_upstream(dapo):
    plan = rlgraph.compile(dapo)
    rf = plan.refill
    assert rf.op == "filter_groups" and (rf.max_rounds, rf.on_exhaust) == (3, "train")
    assert rf.round_ops == ["generate", "reward", "overlong", "filter_groups"]
    # carried: what the rounds made (or the source wrote) that an op after them reads
    assert {"responses", "response_mask", "input_ids", "token_level_scores", "uid", "is_padding"} <= set(rf.carried)
    # read by the rounds' ops only: the reward's inputs and the scores before shaping stay behind
    assert not {"rule_scores", "shaped_scores", "ground_truth", "prompts"} & set(rf.carried)
    for c in rf.carried:
        col = plan.columns[c]
        assert col.stored and col.level == "sample" and any(r not in rf.round_ops for r in col.consumers)
    over = rlgraph.compile(dapo, ["filter_groups.max_rounds=1", "filter_groups.on_exhaust=fail"]).refill
    assert (over.max_rounds, over.on_exhaust) == (1, "fail")
    grpo = load_pipeline(str(ROOT / "examples" / "grpo.py"))[0]
    assert rlgraph.compile(grpo).refill is None


def test_the_svg_shows_the_refill_loop(dapo):
    dot = dot_source(rlgraph.compile(dapo))
    assert "filter_groups -> data" in dot and "style=dotted" in dot
    assert "refill: rounds until 16 groups are kept (at most 3, then train)" in dot
    assert dot.count("runs once per refill round") == 3  # generate, reward, overlong


def test_describe_says_how_the_batch_is_filled(dapo):
    from rich.console import Console

    from rlgraph.graph.describe import describe

    console = Console(width=400, record=True)
    describe(rlgraph.compile(dapo), console)
    text = console.export_text()
    assert ("dynamic sampling  rounds of generate, reward, overlong, filter_groups on fresh prompts until 16 groups "
            "are kept by filter_groups (at most 3, then train)") in text


def test_refill_needs_an_on_policy_run(dapo):
    with pytest.raises(PipelineError) as e:
        rlgraph.compile(dapo, ["trainer.max_staleness=1"])
    assert "refill" in _codes(e.value) and "trainer.max_staleness=0" in str(e.value)


def test_one_refill_per_step(dapo):
    second = stages.filter_groups("shaped_scores", metric_column="rule_scores", name="filter_again")
    ops = [*dapo.ops[:4], second, *dapo.ops[4:]]
    with pytest.raises(PipelineError) as e:
        rlgraph.compile(dataclasses.replace(dapo, ops=ops))
    assert "refill" in _codes(e.value) and "filter_again" in str(e.value)


def test_a_refill_must_be_a_group_filter(dapo):
    bad = [o.with_(granularity="sample", batching=None) if o.name == "filter_groups" else o for o in dapo.ops]
    with pytest.raises(PipelineError) as e:
        rlgraph.compile(dataclasses.replace(dapo, ops=bad))
    assert "is not a group filter" in str(e.value)


@op(outputs={"checked": T.float32("response_len"), "tally": T.json().state()}, group="reward")
def tally(rule_scores: T.float32("response_len")):
    """Keeps a running tally across steps (state), and passes the scores on."""
    return {"checked": rule_scores, "tally": {}}


def test_the_rounds_write_no_state(dapo):
    # an op that keeps state upstream of the filter would run (and change its state) every round
    ops = []
    for o in dapo.ops:
        ops += [tally, stages.filter_groups("shaped_scores", metric_column="checked")] if o.name == "filter_groups" \
            else [o]
    with pytest.raises(PipelineError) as e:
        rlgraph.compile(dataclasses.replace(dapo, ops=[op_spec(o) for o in ops]))
    assert "op 'tally' writes state but runs in every round" in str(e.value)
