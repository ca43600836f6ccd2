"""Typed config params, key=value overrides, and resolution: defaults < pipeline config < overrides."""

from __future__ import annotations

import re

import pytest

from rlgraph import ConfigError, DeclarationError, Param
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.config import flatten, nest, parse_overrides, resolve_config


@pytest.mark.parametrize(
    "param, text, value",
    [
        (Param(int, 1), "45", 45),
        (Param(int, 1), " -3 ", -3),
        (Param(float, 1.0), "1e-6", 1e-6),
        (Param(float, 1.0), "2", 2.0),
        (Param(str, "a"), "token-mean", "token-mean"),
        (Param(str, "a"), "", ""),
        (Param(int, 1, optional=True), "null", None),
        (Param(float, None, optional=True), "None", None),
        (Param(str, None, optional=True), "~", None),
    ],
)
def test_parse_by_declared_type(param, text, value) -> None:
    parsed = param.parse(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["true", "True", "YES", "on", "1"])
def test_bool_true_spellings(text) -> None:
    assert Param(bool, False).parse(text) is True


@pytest.mark.parametrize("text", ["false", "False", "no", "OFF", "0"])
def test_bool_false_spellings(text) -> None:
    assert Param(bool, True).parse(text) is False


@pytest.mark.parametrize(
    "param, text, match",
    [
        (Param(bool, False), "maybe", r"expected a bool \(true/false\), got 'maybe'"),
        (Param(int, 1), "4.5", r"expected an int, got '4\.5'"),
        (Param(int, 1), "null", r"expected an int, got 'null'"),  # not optional
        (Param(float, 1.0), "fast", r"expected a float, got 'fast'"),
    ],
)
def test_parse_errors(param, text, match) -> None:
    with pytest.raises(ValueError, match=match):
        param.parse(text)


@pytest.mark.parametrize(
    "param, value, error",
    [
        (Param(int, 1), 2, None),
        (Param(int, 1), 2.0, r"expected int, got float 2\.0"),
        (Param(int, 1), True, r"expected int, got bool True"),  # a bool is not an int here
        (Param(float, 1.0), 3, None),  # an int is a fine float
        (Param(float, 1.0), False, r"expected float, got bool False"),
        (Param(bool, True), 1, r"expected bool, got int 1"),
        (Param(str, "a"), 5, r"expected str, got int 5"),
        (Param(int, 1), None, r"expected int, got null"),
        (Param(int, 1, optional=True), None, None),
        (Param(str, "a", choices=("a", "b")), "c", r"'c' is not one of 'a', 'b'"),
        (Param(int, 0, choices=(0, 1, 2, 3)), 3, None),
        (Param(int, 1, minimum=1), 0, r"0 is below the minimum 1"),
        (Param(float, 0.5, minimum=0.0), -0.1, r"-0\.1 is below the minimum 0\.0"),
        (Param(float, 0.5, minimum=0.0), 0.0, None),  # the minimum itself is allowed
        (Param(int, 1, minimum=1, optional=True), None, None),
    ],
)
def test_check(param, value, error) -> None:
    got = param.check(value)
    if error is None:
        assert got is None
    else:
        assert got is not None and re.search(error, got), got


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Param(list, []), r"Param type <class 'list'> must be one of int, float, str, bool"),
        (lambda: Param(int), r"Param of type int needs a default \(or optional=True\)"),
        (lambda: Param(str, "z", choices=("a", "b")), r"Param default 'z': 'z' is not one of 'a', 'b'"),
        (lambda: Param(int, 0, minimum=1), r"Param default 0: 0 is below the minimum 1"),
        (lambda: Param(float, "1.0"), r"Param default '1\.0': expected float, got str"),
    ],
)
def test_wrong_param_declarations(make, match) -> None:
    with pytest.raises(DeclarationError, match=match):
        make()


def test_type_name_mentions_null_when_optional() -> None:
    assert Param(int, 1).type_name == "int"
    assert Param(int, None, optional=True).type_name == "int or null"


# Overrides -------------------------------------------------------------------------------------


def test_parse_overrides_splits_at_the_first_equals() -> None:
    assert parse_overrides(["actor.lr=1e-6", " data.batch_size =45", "rollout.stop=a=b", "x.y="]) == {
        "actor.lr": "1e-6", "data.batch_size": "45", "rollout.stop": "a=b", "x.y": ""}
    assert parse_overrides([]) == {}


@pytest.mark.parametrize("item", ["novalue", "=1", " = 1"])
def test_parse_overrides_refuses_items_without_a_key(item) -> None:
    with pytest.raises(ConfigError, match=rf"config override {item!r} is not of the form key=value"):
        parse_overrides([item])


def test_later_override_of_the_same_key_wins() -> None:
    assert parse_overrides(["a.b=1", "a.b=2"]) == {"a.b": "2"}


SCHEMA = {
    "data.batch_size": Param(int, 8, "prompts per step", minimum=1),
    "actor.lr": Param(float, 1e-6, "learning rate"),
    "actor.use_kl_loss": Param(bool, False),
    "actor.loss_agg_mode": Param(str, "token-mean", choices=("token-mean", "seq-mean-token-sum")),
    "rollout.stop": Param(str, None, optional=True),
}


def test_resolution_order() -> None:
    resolved, problems = resolve_config(
        SCHEMA,
        {"data.batch_size": 16, "actor.lr": 1e-4},  # the pipeline's Python config
        {"actor.lr": "0.5", "actor.use_kl_loss": "yes", "rollout.stop": "</s>"},  # the command line
    )
    assert problems == []
    assert resolved == {
        "data.batch_size": 16,  # pipeline config over the default 8
        "actor.lr": 0.5,  # the override over the pipeline's 1e-4
        "actor.use_kl_loss": True,
        "actor.loss_agg_mode": "token-mean",  # default
        "rollout.stop": "</s>",
    }


def test_optional_key_set_to_null() -> None:
    resolved, problems = resolve_config(SCHEMA, {"rollout.stop": "eos"}, {"rollout.stop": "null"})
    assert problems == [] and resolved["rollout.stop"] is None


def test_every_problem_is_collected_and_bad_values_keep_the_default() -> None:
    resolved, problems = resolve_config(
        SCHEMA,
        {"data.batch_sise": 16, "actor.lr": "fast"},
        {"actor.lrr": "1", "data.batch_size": "0", "actor.loss_agg_mode": "foo", "actor.use_kl_loss": "maybe"},
    )
    assert [p.code for p in problems] == ["config-unknown-key", "config-type", "config-unknown-key", "config-type",
                                          "config-type", "config-type"]
    by_msg = {p.message: p.fix for p in problems}
    assert by_msg["the pipeline's config sets unknown config key 'data.batch_sise'"] == \
        "did you mean 'data.batch_size'?"
    assert by_msg["override actor.lrr=1 sets unknown config key 'actor.lrr'"] == "did you mean 'actor.lr'?"
    assert by_msg["override data.batch_size=0: 0 is below the minimum 1"] == "write data.batch_size=<int >= 1>"
    assert by_msg["override actor.loss_agg_mode=foo: 'foo' is not one of 'token-mean', 'seq-mean-token-sum'"]
    assert by_msg["override actor.use_kl_loss=maybe: expected a bool (true/false), got 'maybe'"] == \
        "write actor.use_kl_loss=<bool>"
    assert by_msg["config key 'actor.lr' in the pipeline: expected float, got str 'fast'"] == \
        "give 'actor.lr' a value of type float"
    assert resolved["data.batch_size"] == 8 and resolved["actor.lr"] == 1e-6


def test_unknown_key_without_a_close_match_lists_the_namespace_keys() -> None:
    _, (p,) = resolve_config(SCHEMA, {}, {"actor.momentum": "0.9"})
    assert p.fix == "keys under 'actor' are: actor.loss_agg_mode, actor.lr, actor.use_kl_loss"
    _, (p,) = resolve_config(SCHEMA, {}, {"optimizer.momentum": "0.9"})
    assert p.fix.startswith("known namespaces are: actor, data, rollout;")


def test_nest_and_flatten_are_inverse() -> None:
    flat = {"actor.lr": 0.1, "groups.actor.dp": 2, "data.batch_size": 8}
    tree = {"actor": {"lr": 0.1}, "groups": {"actor": {"dp": 2}}, "data": {"batch_size": 8}}
    assert nest(flat) == tree
    assert flatten(tree) == flat


def test_compiled_config_is_typed_by_the_schema(ppo) -> None:
    plan = compile_pipeline(ppo, ["actor.use_kl_loss=on", "actor.lr=3e-5", "groups.actor.num_gpus=0",
                                  "rollout.temperature=0"])
    cfg = plan.config
    assert cfg["actor"]["use_kl_loss"] is True
    assert cfg["actor"]["lr"] == 3e-5
    assert cfg["groups"]["actor"]["num_gpus"] == 0.0 and isinstance(cfg["groups"]["actor"]["num_gpus"], float)
    assert cfg["rollout"]["temperature"] == 0.0
    assert plan.op("update_actor").params["use_kl_loss"] is True
