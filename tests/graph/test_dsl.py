"""The declaration layer: @op reads a function's signature, leaves the function alone, and every
wrong declaration raises `DeclarationError` where it is written."""

from __future__ import annotations

import dataclasses

import pytest

from rlgraph import (Batching, ColumnType, DataSource, DeclarationError, OpSpec, Param, Pipeline, T, WorkerGroup,
                     op, op_spec)
from rlgraph.graph.dsl import SYSTEM_COLUMNS
from rlgraph.ops import stages


def scale_score(score: T.float32(), response_mask: T.int64("response_len"), ctx=None, *, scale: float = 2.0,
                greedy: bool = False, top_k=3, label: Param(str, "x", "a label", choices=("x", "y")) = "x"):
    """Multiply the score."""
    return score * scale


scale_score_op = op(scale_score, outputs={"scaled": T.float32()}, group="workers")


def test_op_returns_the_same_function_still_callable() -> None:
    assert scale_score_op is scale_score
    assert scale_score(1.5, [1], scale=4.0) == 6.0  # called like any function
    assert scale_score(1.5, [1]) == 3.0


def test_inputs_come_from_positional_parameters() -> None:
    spec = op_spec(scale_score)
    assert isinstance(spec, OpSpec)
    assert dict(spec.inputs) == {"score": T.float32(), "response_mask": T.int64("response_len")}
    assert "ctx" not in spec.inputs and "ctx" not in spec.params
    assert dict(spec.outputs) == {"scaled": T.float32()}
    assert spec.name == "scale_score" and spec.group == "workers" and spec.granularity == "sample"
    assert spec.doc == "Multiply the score."


def test_params_come_from_keyword_only_parameters() -> None:
    params = op_spec(scale_score).params
    assert list(params) == ["scale", "greedy", "top_k", "label"]
    assert params["scale"] == Param(float, 2.0)
    assert params["greedy"] == Param(bool, False)
    assert params["top_k"] == Param(int, 3)  # unannotated: typed by its default
    assert params["label"].choices == ("x", "y")  # a Param annotation is used as it is


def test_impl_is_an_import_path_to_the_function() -> None:
    spec = op_spec(scale_score)
    module, qualname = spec.impl.split(":")
    assert qualname == "scale_score"
    assert module == scale_score.__module__


def _module_level_body(x, *, mini: int = 2):
    return x


def test_op_options_are_recorded() -> None:
    spec = op_spec(op(_module_level_body, outputs={"y": T.float32().metric()}, inputs={"x": T.float32()},
                      name="renamed", granularity="batch", group="g", config_key="ns",
                      batching=Batching(mini_batch="mini"), cost=2.5))
    assert spec.name == "renamed" and spec.namespace == "ns"
    assert dict(spec.inputs) == {"x": T.float32()}  # typed through inputs=
    assert dict(spec.params) == {"mini": Param(int, 2)}
    assert spec.batching == Batching(mini_batch="mini") and spec.cost == 2.5
    assert spec.impl.endswith(":_module_level_body")


class CriticWorker:
    """A worker class: its decorated methods are ops; `self` is not a column."""

    def __init__(self) -> None:
        self.bias = 1.0

    @op(outputs={"values": T.float32("response_len")}, group="critic")
    def compute_values(self, input_ids: T.int64("seq_len"), ctx, *, micro_batch_size: int = 4):
        return [self.bias] * len(input_ids)


def test_methods_of_a_worker_class() -> None:
    spec = op_spec(CriticWorker.compute_values)
    assert spec.name == "compute_values"
    assert dict(spec.inputs) == {"input_ids": T.int64("seq_len")}
    assert list(spec.params) == ["micro_batch_size"]
    assert spec.impl.endswith(":CriticWorker.compute_values")
    assert CriticWorker().compute_values([1, 2, 3], None) == [1.0, 1.0, 1.0]  # the method is unchanged


def test_op_spec_of_an_opspec_is_itself() -> None:
    spec = stages.ref()
    assert op_spec(spec) is spec


def test_with_returns_a_changed_copy() -> None:
    spec = stages.ref()
    moved = spec.with_(group="reference", name="ref2")
    assert (moved.group, moved.name) == ("reference", "ref2")
    assert (spec.group, spec.name) == ("actor", "ref")


# Declaration errors ---------------------------------------------------------------------------


def _declare(fn, **kw):
    kw.setdefault("outputs", {"y": T.float32()})
    return op(fn, **kw)


def untyped(x, *, k: int = 1): ...
def star_args(*cols): ...
def star_kwargs(x: T.float32(), **extra): ...
def no_default(x: T.float32(), *, k: int): ...
def list_param(x: T.float32(), *, ks: list = []): ...  # noqa: B006
def bad_default(x: T.float32(), *, k: int = 0.5): ...
def plain(x: T.float32()): ...
def bad_annotation(x: T.no_such_dtype()): ...  # a string under `from __future__ import annotations`


WRONG_OPS = [
    (untyped, {}, r"op 'untyped': input parameter 'x' has no column type; annotate it, e\.g\. `x: T\.float32"),
    (star_args, {}, r"op 'star_args': \*cols / \*\*cols are not allowed; name each input column"),
    (star_kwargs, {}, r"op 'star_kwargs': \*extra / \*\*extra are not allowed"),
    (no_default, {}, r"op 'no_default': config parameter 'k' needs a default value"),
    (list_param, {}, r"op 'list_param': config parameter 'ks' must be int, float, str or bool"),
    (bad_default, {}, r"op 'bad_default': config parameter 'k': Param default 0\.5: expected int, got float"),
    (plain, {"inputs": {"z": T.float32()}}, r"op 'plain': inputs= names \['z'\] which are not parameters"),
    (plain, {"params": {"x": Param(int, 1)}}, r"op 'plain': \['x'\] are both input columns and params"),
    (plain, {"outputs": {}}, r"op 'plain' declares no output columns"),
    (plain, {"outputs": {"y": "float32"}}, r"op 'plain': output column 'y' is typed 'float32'; give a column "
                                           r"type such as T\.int64\('response_len'\)"),
    (plain, {"name": "not-a-name"}, r"op name 'not-a-name' must be a Python identifier"),
    (plain, {"granularity": "token"}, r"op 'plain': granularity 'token' must be one of sample, group, batch"),
    (plain, {"optional_inputs": ["w"]}, r"op 'plain': optional inputs \['w'\] are not among its inputs"),
    (plain, {"batching": Batching(mini_batch="mb")}, r"op 'plain': batching refers to param 'mb', which it "
                                                     r"does not declare"),
    (plain, {"group_size_param": "n"}, r"op 'plain': batching refers to param 'n'"),
    (plain, {"params": {"k": 3}}, r"op 'plain': param 'k' must be a Param, got 3"),
    (bad_annotation, {}, r"op 'bad_annotation': cannot evaluate its annotations"),
]


@pytest.mark.parametrize(
    "fn, kw, match",
    [pytest.param(fn, kw, m, id=f"{fn.__name__}-{'-'.join(kw) or 'signature'}") for fn, kw, m in WRONG_OPS],
)
def test_wrong_op_declarations(fn, kw, match) -> None:
    with pytest.raises(DeclarationError, match=match):
        _declare(fn, **kw)


def test_op_defined_inside_a_function_is_refused() -> None:
    with pytest.raises(DeclarationError, match=r"op 'inner' is defined inside a function .*; define it at module "
                                               r"level so workers can import it"):
        @op(outputs={"y": T.float32()})
        def inner(x: T.float32()): ...


def test_op_spec_of_a_plain_function() -> None:
    with pytest.raises(DeclarationError, match=r"is not an operator; decorate a function with @rlgraph\.op\(outputs=\.\.\.\)"):
        op_spec(len)


def test_unknown_dtype_attribute() -> None:
    with pytest.raises(AttributeError, match=r"T\.float31: unknown dtype; use one of float16"):
        T.float31()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ColumnType("fp32"), r"unknown dtype 'fp32'"),
        (lambda: T.float32(-1), r"shape dimension -1 must be >= 0"),
        (lambda: T.float32(True), r"shape dimension True must be an int"),
        (lambda: ColumnType("int64", level="token"), r"level 'token' must be 'sample' or 'batch'"),
        (lambda: ColumnType("int64", kind="weights"), r"kind 'weights' must be 'data', 'state' or 'metric'"),
        (lambda: WorkerGroup("my-group"), r"worker group name 'my-group' must be a Python identifier"),
        (lambda: DataSource({"uid": T.int64()}), r"data source column 'uid' is a system column"),
        (lambda: DataSource({"prompt": str}), r"data source 'data': column 'prompt' is typed with the Python type str; column types come from T, "
                                                   r"e\.g\. T\.str\(\)"),
        (lambda: Pipeline("p", {"prompt": T.str()}, []), r"pipeline 'p': source= is a dict of columns; wrap it in a DataSource"),
        (lambda: Pipeline("p", DataSource({}), [], groups=["actor"]), r"pipeline 'p': groups\[0\] must be a WorkerGroup, got str 'actor'; write WorkerGroup\('actor'\)"),
        (lambda: Pipeline("p", DataSource({}), [plain]), r"is not an operator"),
        (lambda: stages.advantage("ppo"), r"unknown advantage estimator 'ppo'; use one of gae, grpo"),
    ],
)
def test_wrong_declarations_elsewhere(make, match) -> None:
    with pytest.raises(DeclarationError, match=match):
        make()


# Pipelines ------------------------------------------------------------------------------------


def test_pipeline_is_immutable_and_not_callable() -> None:
    p = Pipeline("p", DataSource({"score": T.float32()}), [scale_score], [WorkerGroup("workers")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "q"  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"use `rlgraph run` or rlgraph\.compile\(pipeline\)"):
        p()
    with pytest.raises(KeyError, match=r"no op 'nope' in pipeline 'p'"):
        p.op("nope")
    assert p.op("scale_score") is op_spec(scale_score)


def test_pipeline_copies(ppo) -> None:
    fewer = ppo.with_ops(drop=["ref"])
    assert [o.name for o in fewer.ops] == ["generate", "reward", "old_logprob", "values", "advantage",
                                           "update_critic", "update_actor"]
    moved = ppo.with_ops(stages.ref(group="critic"))
    assert moved.op("ref").group == "critic" and ppo.op("ref").group == "actor"
    cfg = ppo.with_config(actor={"lr": 0.5})
    assert cfg.config["actor"] == {"lr": 0.5, "mini_batch_size": 4}
    assert ppo.config["actor"]["lr"] == 1e-4


def test_source_provides_system_columns_and_batch_size() -> None:
    src = DataSource({"prompt": T.str()})
    assert set(src.all_columns()) == {"prompt", *SYSTEM_COLUMNS} == {"prompt", "uid", "is_padding"}
    assert src.params["batch_size"].default == 8
