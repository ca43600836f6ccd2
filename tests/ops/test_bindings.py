"""Every built-in stage's body accepts exactly what its declaration passes it (no catch-alls).

A declaration (`rlgraph.ops.stages`) and its body (a worker-class method) live in different
modules; this test and the runtime's own check at start-up (`BindingError`) keep them bound.
"""

import inspect

import pytest

from rlgraph.graph.loader import resolve_impl
from rlgraph.ops import stages
from rlgraph.ops.names import ESTIMATORS
from rlgraph.runtime.invoke import binding_problems

SPECS = {
    "generate": stages.generate(),
    "reward": stages.reward(),
    "reward_rule_scores": stages.reward(name="rule", score_column="rule_scores"),
    "reward_model": stages.reward_model(),
    "reward_model_generative": stages.reward_model(kind="generative"),
    "teacher_logprob": stages.teacher_logprob(),
    "combine_rewards": stages.combine_rewards({"rule_scores": 1.0, "rm_scores": 0.5}),
    "old_logprob": stages.old_logprob(),
    "ref": stages.ref(),
    "values": stages.values(),
    **{f"advantage_{e}": stages.advantage(e) for e in ESTIMATORS},
    "update_critic": stages.update_critic(),
    "update_actor": stages.update_actor(),
}


def _body(spec):
    obj, method = resolve_impl(spec.impl)
    return getattr(obj, method).__get__(object()) if method else obj  # a method, bound: no `self`


@pytest.mark.parametrize("name", sorted(SPECS))
def test_stage_body_matches_its_declaration(name):
    spec = SPECS[name]
    assert binding_problems(_body(spec), spec.inputs, spec.params, spec.runtime_params) == []


@pytest.mark.parametrize("name", sorted(SPECS))
def test_stage_bodies_take_no_catch_all_except_declared_column_sets(name):
    params = inspect.signature(_body(SPECS[name])).parameters.values()
    var_kw = [p.name for p in params if p.kind == p.VAR_KEYWORD]
    # combine_rewards' score columns are named by its weights at declaration: the body takes them as **inputs
    assert var_kw == (["inputs"] if name == "combine_rewards" else [])


def test_a_declared_param_missing_from_a_body_is_found():
    spec = stages.update_actor()
    fewer = {k: v for k, v in spec.params.items()}
    fewer["new_knob"] = fewer["lr"]
    assert binding_problems(_body(spec), spec.inputs, fewer, spec.runtime_params) == [
        "does not accept declared param(s) ['new_knob']"]


def test_the_rule_reward_takes_its_responses_as_rows_only_with_its_own_body():
    # the built-in body reads rows; a body of one's own, bound here or through with_, gets them padded
    # unless it names as_rows, and inputs declared without the mask keep what they have
    assert stages.reward().as_rows == {"responses", "response_mask"}
    assert stages.reward(impl="my_rewards:score").as_rows == frozenset()
    assert stages.reward().with_(impl="my_rewards:score").as_rows == frozenset()
    assert stages.reward(impl="my_rewards:score", as_rows=["responses"]).as_rows == {"responses"}
    fewer = {k: v for k, v in stages.reward().inputs.items() if k != "response_mask"}
    assert stages.reward(inputs=fewer).as_rows == {"responses"}
    assert stages.reward().with_(inputs=fewer).as_rows == {"responses"}
