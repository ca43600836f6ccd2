"""The calling convention and padding rows, without Ray."""

import textwrap
from types import SimpleNamespace

import pytest
import torch

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup, op
from rlgraph.graph.config import Param
from rlgraph.graph.loader import resolve_impl
from rlgraph.runtime.invoke import BindingError, Invoker, OpError, binding_problems
from rlgraph.seeds import stable_seed
from rlgraph.runtime.source import SourceError, expand_and_pad


def source_columns(plan):
    return {c: plan.columns[c] for c in plan.source_columns}

R = "response_len"


@op(outputs={"scaled": T.float32(R), "total": T.float32()}, group="w")
def scale(tokens: T.float32(R), mask: T.int64(R), *, factor: float = 2.0, ctx=None):
    # dense [rows, max_len] in, dense out: the runtime trims each row back to its length
    return {"scaled": tokens * factor * mask, "total": (tokens * mask).sum(dim=1)}


@op(outputs={"wrong": T.float32()}, group="w")
def bad_rows(tokens: T.float32(R)):
    return {"wrong": torch.zeros(len(tokens) + 1)}


@op(outputs={"a": T.float32(), "b": T.float32()}, group="w")
def missing_output(tokens: T.float32(R)):
    return {"a": torch.zeros(len(tokens)), "c": 1}


def _plan(*ops):
    src = DataSource({"tokens": T.float32(R), "mask": T.int64(R)})
    return rlgraph.compile(Pipeline("p", src, ops, [WorkerGroup("w")], outputs=[c for o in ops for c in
                                                                                rlgraph.op_spec(o).outputs]))


def test_ragged_inputs_are_right_padded_and_dense_outputs_trimmed():
    plan = _plan(scale)
    inv = Invoker(plan, "w", 0, 1)
    rows = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    masks = [torch.ones(3, dtype=torch.int64), torch.ones(1, dtype=torch.int64)]
    out = inv.call(plan.op("scale"), step=0, chunk=0, rows=[0, 1], is_padding=[False, False],
                   inputs={"tokens": rows, "mask": masks})
    # 1,2,3 x 2 and 4 x 2, trimmed per row to the lengths of the input with the same dim name
    assert [t.tolist() for t in out["scaled"]] == [[2.0, 4.0, 6.0], [8.0]]
    assert out["total"].tolist() == [6.0, 4.0]
    assert out["scaled"][0].dtype == torch.float32


def test_params_reach_the_body():
    plan = rlgraph.compile(_pipeline_with(scale), ["scale.factor=10"])
    out = Invoker(plan, "w", 0, 1).call(plan.op("scale"), 0, 0, [0], [False],
                                        {"tokens": [torch.tensor([1.0])], "mask": [torch.tensor([1])]})
    assert out["scaled"][0].tolist() == [10.0]


def _pipeline_with(*ops):
    src = DataSource({"tokens": T.float32(R), "mask": T.int64(R)})
    return Pipeline("p", src, ops, [WorkerGroup("w")], outputs=[c for o in ops for c in rlgraph.op_spec(o).outputs])


@pytest.mark.parametrize("fn, message", [
    (bad_rows, r"op 'bad_rows': output 'wrong' has 3 rows for a call on 2 rows; return one entry per row"),
    (missing_output, r"op 'missing_output' returned columns \['a', 'c'\], but declares \['a', 'b'\]; "
                     r"missing \['b'\]; undeclared \['c'\]"),
])
def test_outputs_that_do_not_match_the_declaration_are_rejected(fn, message):
    plan = _plan(fn)
    inv = Invoker(plan, "w", 0, 1)
    with pytest.raises(OpError, match=message):
        inv.call(plan.op(fn.__name__), 0, 0, [0, 1], [False, False],
                 {"tokens": [torch.ones(2), torch.ones(1)]})


def test_seed_is_stable_across_processes():
    # sha256-based, unlike hash(): the same in every worker and every run
    assert stable_seed(0, 1, "gen", 2) == stable_seed(0, 1, "gen", 2)
    assert stable_seed(0, 1, "gen", 2) != stable_seed(0, 1, "gen", 3)
    assert 0 <= stable_seed("x") < 2**31
    assert stable_seed(0, 1, "gen", 2) == 1971621483  # SHA-256's, as every earlier version gave it: runs reproduce


def test_ops_of_a_script_run_as_main_are_imported_from_its_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        RAN_MAIN = False

        def my_op(x):
            return {"y": x}

        if __name__ == "__main__":
            RAN_MAIN = True
    """))
    fn, method = resolve_impl("__main__:my_op", str(script))
    assert method is None and fn({"a": 1}) == {"y": {"a": 1}}
    assert fn.__globals__["RAN_MAIN"] is False  # the script's main block did not run


def test_unknown_body_names_the_reference():
    with pytest.raises(OpError, match=r"op body 'rlgraph.errors:Nope': 'rlgraph.errors' has no attribute 'Nope'"):
        resolve_impl("rlgraph.errors:Nope")


def test_padding_rows_are_minimal_with_fresh_groups():
    plan = _plan(scale)
    cols = source_columns(plan)
    batch = {"tokens": [torch.ones(4), torch.ones(2)], "mask": [torch.ones(4, dtype=torch.int64)] * 2}
    rows = expand_and_pad(batch, cols, n=3, padded_rows=8, uid_start=100)
    # 2 prompts x 3 = 6 real rows, contiguous per prompt; 2 padding rows, each its own group
    assert rows.uids == [100, 100, 100, 101, 101, 101, 102, 103]
    assert rows.is_padding == [False] * 6 + [True] * 2
    assert [len(t) for t in rows.columns["tokens"]] == [4, 4, 4, 2, 2, 2, 1, 1]
    assert rows.columns["tokens"][6].tolist() == [0.0] and rows.columns["mask"][7].tolist() == [0]
    assert rows.columns["uid"].tolist() == rows.uids and rows.columns["uid"].dtype == torch.int64
    assert rows.columns["is_padding"].tolist() == rows.is_padding and rows.columns["is_padding"].dtype == torch.bool


def test_source_batches_that_do_not_match_are_rejected():
    cols = source_columns(_plan(scale))
    with pytest.raises(SourceError, match=r"lacks declared columns \['mask'\]"):
        expand_and_pad({"tokens": [torch.ones(1)]}, cols, 1, 4, 0)
    with pytest.raises(SourceError, match=r"5 prompts x n=2 = 10 samples exceed the padded batch of 8"):
        expand_and_pad({"tokens": [torch.ones(1)] * 5, "mask": [torch.ones(1)] * 5}, cols, 2, 8, 0)


def test_overrides_may_be_typed_values_or_one_string():
    pipeline = _pipeline_with(scale)
    assert rlgraph.compile(pipeline, {"scale.factor": 0.5}).op("scale").params["factor"] == 0.5
    assert rlgraph.compile(pipeline, "scale.factor=3").op("scale").params["factor"] == 3.0
    with pytest.raises(rlgraph.PipelineError, match=r"override scale.factor=big: expected a float, got 'big'"):
        rlgraph.compile(pipeline, {"scale.factor": "big"})
    with pytest.raises(rlgraph.PipelineError, match=r"override scale.factor=\[1\]: expected float, got list"):
        rlgraph.compile(pipeline, {"scale.factor": [1]})


@op(outputs={"o": T.float32()}, group="w")
def micro(tokens: T.float32(R), *, micro_batch_size: int = 3):
    return {"o": torch.zeros(len(tokens))}


def test_micro_batch_size_param_implies_micro_batching():
    assert rlgraph.op_spec(micro).batching.micro_batch == "micro_batch_size"
    assert rlgraph.op_spec(scale).batching is None  # no such param: no micro-batching


@op(outputs={"o": T.float32()}, group="w")
def sees_ctx(tokens: T.float32(R), *, micro_batch_size: int = 1, ctx=None):
    return {"o": torch.full((len(tokens),), float(ctx.group_size * 100 + ctx.batching.micro_batch_size))}


@op(outputs={"o": T.float32()}, group="w")
def ignores_micro(tokens: T.float32(R), *, ctx=None):
    return {"o": torch.zeros(len(tokens))}


def test_ctx_carries_the_plans_batching_and_runtime_params_are_passed_only_when_named():
    plan = rlgraph.compile(_pipeline_with(sees_ctx), ["sees_ctx.micro_batch_size=4"])
    assert plan.op("sees_ctx").runtime_params == ["micro_batch_size"]
    out = Invoker(plan, "w", 0, 1).call(plan.op("sees_ctx"), 0, 0, [0], [False], {"tokens": [torch.ones(1)]})
    assert out["o"].tolist() == [104.0]  # n = 1 (no generator), 4 samples per call
    spec = rlgraph.op_spec(ignores_micro).with_(params={"micro_batch_size": Param(int, 2)},
                                               batching=rlgraph.Batching(micro_batch="micro_batch_size"))
    plan = rlgraph.compile(_pipeline_with(spec))
    Invoker(plan, "w", 0, 1).call(plan.op("ignores_micro"), 0, 0, [0], [False], {"tokens": [torch.ones(1)]})


_SEEN: list = []


@op(outputs={"o": T.float32()}, group="w")
def keeps_ctx(tokens: T.float32(R), *, ctx=None):
    _SEEN.append(ctx)
    return {"o": torch.zeros(len(tokens))}


def test_the_runtime_s_context_is_what_its_constructor_gives_with_the_seed_hashed_when_read():
    import dataclasses

    from rlgraph.runtime.invoke import OpContext
    from rlgraph.seeds import stable_seed

    plan = rlgraph.compile(_pipeline_with(keeps_ctx))
    inv = Invoker(plan, "w", 0, 1)
    _SEEN.clear()
    for step in (3, 4):
        inv.call(plan.op("keeps_ctx"), step, 1, [5, 6], [False, True], {"tokens": [torch.ones(2), torch.ones(1)]}, salt=2)
    first, second = _SEEN
    assert "seed" not in vars(first)  # not hashed until read
    assert first.seed == stable_seed(inv.seed, 3, "keeps_ctx", 1, 2) and second.seed != first.seed
    made = OpContext(**{f.name: getattr(first, f.name) for f in dataclasses.fields(OpContext)})
    assert made == first and repr(made) == repr(first)  # every field set, as the constructor sets them
    assert (first.rows, first.is_padding, first.lengths, first.chunks) == ((5, 6), (False, True), {"response_len": (2, 1)}, (2,))
    assert first.dropped is not second.dropped and first.events is not second.events  # each call its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.step = 9
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        first.nope


@op(outputs={"o": T.float32(), "m": T.json().metric()}, granularity="group", group="w", vectorised=True)
def per_group_total(tokens: T.float32(R), *, ctx=None):
    """Vectorised: one record per chunk, each chunk's size."""
    return {"o": tokens.sum(dim=1), "m": [{"rows": n} for n in ctx.chunks]}


def test_a_vectorised_op_sees_its_chunks_and_gives_a_metrics_record_per_chunk():
    from rlgraph.runtime.worker import _chunk_metrics, _OpColumns

    plan = rlgraph.compile(_pipeline_with(per_group_total))
    o = plan.op("per_group_total")
    assert o.vectorised and not o.streams
    inv = Invoker(plan, "w", 0, 1)
    rows = [torch.ones(2)] * 5
    out = inv.call(o, 0, 3, range(5), [False] * 5, {"tokens": rows}, chunks=(2, 3))
    assert out["m"] == [{"rows": 2}, {"rows": 3}]
    assert _chunk_metrics(_OpColumns.of(plan, o).metrics, o, [out], 2) == [{"m": {"rows": 2}}, {"m": {"rows": 3}}]
    with pytest.raises(OpError, match=r"list of 2 records for a call of 3 chunks"):
        _chunk_metrics(_OpColumns.of(plan, o).metrics, o, [out], 3)
    # a call of one chunk (any op that is not vectorised) sees that chunk alone
    assert inv.call(o, 0, 0, range(2), [False] * 2, {"tokens": rows[:2]})["m"] == [{"rows": 2}]
    with pytest.raises(rlgraph.DeclarationError, match="vectorised=True is for per-sample and per-group ops"):
        rlgraph.op_spec(per_group_total).with_(granularity="batch")


@pytest.mark.parametrize("change, message", [
    (dict(params={"factor": Param(float, 2.0), "offset": Param(float, 0.0)}),
     r"op 'scale': its body .*:scale does not accept declared param\(s\) \['offset'\]"),
    (dict(inputs={"tokens": T.float32(R), "mask": T.int64(R), "extra": T.float32(R)}),
     r"does not accept declared input column\(s\) \['extra'\]"),
    (dict(inputs={"tokens": T.float32(R)}),
     r"requires argument\(s\) \['mask'\], which the op declares neither as input columns nor as params"),
])
def test_a_body_that_does_not_match_its_declaration_fails_at_start_up(change, message):
    src = DataSource({"tokens": T.float32(R), "mask": T.int64(R), "extra": T.float32(R)})
    spec = rlgraph.op_spec(scale).with_(**change)
    plan = rlgraph.compile(Pipeline("p", src, [spec], [WorkerGroup("w")], outputs=["scaled", "total"]))
    with pytest.raises(BindingError, match=message + r".*Make the body's signature match the declaration"):
        Invoker(plan, "w", 0, 1)


def test_binding_problems_accepts_kwargs_and_defaults():
    def takes_all(a, *, ctx=None, **columns):
        return {}

    def extra_with_default(a, b=None, *, k=1):
        return {}

    assert binding_problems(takes_all, ["a", "b"], ["k"]) == []
    assert binding_problems(extra_with_default, ["a"], ["k"]) == []  # b has a default: never required
    assert binding_problems(extra_with_default, ["a"], ["k", "micro"], runtime_params=["micro"]) == []


@op(outputs={"o": T.float32()}, group="w")
def drops_undeclared(tokens: T.float32(R), *, ctx=None):
    ctx.drop(0, "bad")
    return {"o": torch.zeros(len(tokens))}


@op(outputs={"o": T.float32()}, group="w", drops=True)
def drops_declared(tokens: T.float32(R), *, ctx=None):
    ctx.drop(1, "bad", group=True)
    return {"o": torch.zeros(len(tokens))}


def test_only_an_op_declared_to_drop_rows_may_drop_them():
    plan = _plan(drops_undeclared)
    assert plan.op("drops_undeclared").downstream == []
    with pytest.raises(OpError, match=r"op 'drops_undeclared' called ctx.drop but is not planned to drop rows; "
                                      r"declare it with drops=True"):
        Invoker(plan, "w", 0, 1).call(plan.op("drops_undeclared"), 0, 0, [0, 1], [False, False],
                                      {"tokens": [torch.ones(1), torch.ones(1)]})
    plan = _plan(drops_declared)
    inv = Invoker(plan, "w", 0, 1)
    inv.call(plan.op("drops_declared"), 0, 0, [0, 1], [False, False], {"tokens": [torch.ones(1), torch.ones(1)]})
    assert inv.last_dropped == {1: ("bad", True)}


def test_rows_that_are_not_all_one_dimensional_are_left_to_pad_sequence():
    from rlgraph.graph.plan import ColumnPlan
    from rlgraph.runtime.invoke import to_call_value

    rows = [torch.ones(2, 3), torch.full((1, 3), 2.0)]
    assert torch.equal(to_call_value(ColumnPlan(name="x", dtype="float32", shape=["T", 3], level="sample",
                                                   kind="data", producer="p", consumers=[], stored=True), rows),
                       torch.nn.utils.rnn.pad_sequence(rows, batch_first=True))


def test_ragged_rows_are_padded_once_for_all_their_readers_and_each_reader_gets_its_own_copy():
    # a column kept as Rows (an op's dense ragged output, cut to its rows' lengths) is padded once; every
    # call gets a copy of that padding in the column's dtype, so what one body changes never reaches the next
    from rlgraph.graph.plan import ColumnPlan, OpPlan
    from rlgraph.rows import Rows
    from rlgraph.runtime.invoke import _convert, to_call_value

    col = ColumnPlan(name="x", dtype="int64", shape=["T"], level="sample", kind="data", producer="p", consumers=[],
                     stored=True)
    dense = torch.tensor([[1, 2, 9], [3, 9, 9], [4, 5, 6]])  # 9: what the body left beyond each row's length
    plan = SimpleNamespace(columns={"x": col})
    rows = _convert(plan, OpPlan.model_construct(name="p"), "x", dense, 3, {"T": [2, 1, 3]})
    assert type(rows) is Rows and [r.tolist() for r in rows] == [[1, 2], [3], [4, 5, 6]]
    assert _convert(plan, OpPlan.model_construct(name="p"), "x", rows, 3, {}) is rows  # kept as they are
    first = to_call_value(col, rows)
    assert first.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    first.zero_()  # a body changes its argument in place
    assert to_call_value(col, rows).tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    as_float = to_call_value(col.model_copy(update={"dtype": "float32"}), rows)
    assert as_float.dtype == torch.float32 and as_float.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    fixed = col.model_copy(update={"shape": [3]})  # rows of a fixed shape are stacked, never padded
    with pytest.raises(RuntimeError):
        to_call_value(fixed, rows)


def test_row_sums_are_each_row_s_sum_for_every_shape_of_row():
    # the summaries a call reports (each real row's sum): 1-D rows joined as they are, any other shape flattened
    from rlgraph.rows import Rows
    from rlgraph.runtime.worker import _row_sums

    g = torch.Generator().manual_seed(2)
    cases = [
        [torch.rand(n, generator=g) for n in (3, 0, 5, 1)],  # ragged token rows
        [torch.rand(n, 2, generator=g) for n in (2, 1, 3)],  # 2-D rows
        [torch.tensor(1.5), torch.tensor(-2.0)],  # 0-d rows
        [torch.rand(2, generator=g), torch.rand(1, 2, generator=g)],  # mixed numbers of dimensions
        Rows(torch.rand(6, generator=g), [2, 0, 4]),  # 1-D rows of one flat tensor
        Rows(torch.rand(6, generator=g), [2, 1, 3]),  # ... none empty
        Rows(torch.tensor([True, False, True, True]), [3, 1]),  # booleans count as ones
        Rows(torch.rand(5, generator=g).to(torch.float8_e4m3fn), [2, 3]),  # a dtype numpy has not
        Rows(torch.rand(5, generator=g), [0, 0, 2, 3, 0, 0]),  # empty rows first and last
        Rows(torch.rand(0, generator=g), [0, 0]),  # no elements at all
        Rows(torch.rand(5000, generator=g), [2500, 0, 2500]),  # more than Python sums: numpy's reduction
        Rows(torch.rand(5000, generator=g), [1000] * 5),  # ... none empty
        Rows(torch.randint(-2**40, 2**40, (6,), generator=g), [2, 4]),  # int64: numpy's, in float64 as before
        Rows(torch.rand(6, generator=g, dtype=torch.float64).to(torch.bfloat16), [4, 2]),  # not numpy's, as a Rows
        [torch.rand(n, generator=g, dtype=torch.float64).to(torch.bfloat16) for n in (2, 0, 3)],  # not numpy's dtype
        [torch.rand(n, generator=g, requires_grad=True) for n in (2, 3)],  # rows a body left in autograd
        [[1, 2, 3], [4]],  # lists of numbers
        torch.rand(4, 3, generator=g),  # a dense column
    ]
    for rows in cases:
        expected = [float(torch.as_tensor(r).detach().double().sum()) for r in rows]
        assert _row_sums(rows) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert _row_sums([]) == []


@op(outputs={"last": T.float32(), "echo": T.float32(R)}, group="w", as_rows=["tokens"])
def last_token(tokens: T.float32(R), mask: T.int64(R)):
    # tokens come as their rows (as_rows), the mask padded as usual
    assert type(tokens) is rlgraph.rows.Rows and isinstance(mask, torch.Tensor)
    return {"last": torch.tensor([float(r[-1]) if r.numel() else 0.0 for r in tokens]), "echo": tokens}


@op(outputs={"last": T.float32()}, group="w", as_rows="tokens")
def changes_its_rows(tokens: T.float32(R)):
    tokens[0].mul_(2)  # in place, on the runtime's own tensor
    return {"last": torch.zeros(len(tokens))}


def test_an_input_taken_as_rows_comes_as_the_runtime_s_rows_without_padding_or_a_copy():
    import rlgraph.rows
    from rlgraph.rows import Rows

    plan = _plan(last_token)
    assert plan.op("last_token").as_rows == ["tokens"]
    inv = Invoker(plan, "w", 0, 1)
    stored = Rows(torch.tensor([1.0, 2.0, 3.0, 4.0]), [3, 0, 1])
    masks = [torch.ones(n, dtype=torch.int64) for n in (3, 0, 1)]
    out = inv.call(plan.op("last_token"), step=0, chunk=0, rows=[0, 1, 2], is_padding=[False] * 3,
                   inputs={"tokens": stored, "mask": masks})
    assert out["last"].tolist() == [3.0, 0.0, 4.0]
    assert out["echo"] is not stored and out["echo"].flat is stored.flat  # the same tensor: no copy either way
    assert [r.tolist() for r in out["echo"]] == [[1.0, 2.0, 3.0], [], [4.0]]
    # stored as a plain list of rows, or dense (every row as long): given as rows all the same
    as_list = inv.call(plan.op("last_token"), step=0, chunk=0, rows=[0, 1], is_padding=[False] * 2,
                       inputs={"tokens": [torch.tensor([5.0]), torch.tensor([6.0, 7.0])], "mask": masks[:2]})
    dense = inv.call(plan.op("last_token"), step=0, chunk=0, rows=[0, 1], is_padding=[False] * 2,
                     inputs={"tokens": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "mask": torch.ones(2, 2).long()})
    assert as_list["last"].tolist() == [5.0, 7.0] and dense["last"].tolist() == [2.0, 4.0]
    assert type(rlgraph.rows.rows_of([[1, 2], [3]], torch.int64)) is Rows


@op(outputs={"echo": T.float32(R)}, group="w", as_rows=["tokens"])
def short_rows(tokens: T.float32(R)):
    return {"echo": rlgraph.rows.Rows(tokens.flat[:-1], [*tokens.lengths[:-1], tokens.lengths[-1] - 1])}


def test_rows_returned_for_a_ragged_output_must_be_as_long_as_the_call_s_rows():
    from rlgraph.rows import Rows

    plan = _plan(short_rows)
    inv = Invoker(plan, "w", 0, 1)
    with pytest.raises(OpError, match=r"output 'echo' has rows of lengths \[2, 0\], but the call's rows are \[2, 1\]"):
        inv.call(plan.op("short_rows"), step=0, chunk=0, rows=[0, 1], is_padding=[False] * 2,
                 inputs={"tokens": Rows(torch.tensor([1.0, 2.0, 3.0]), [2, 1])})


def test_a_body_that_changes_rows_it_was_given_in_place_fails_its_call():
    from rlgraph.rows import Rows

    plan = _plan(changes_its_rows)
    inv = Invoker(plan, "w", 0, 1)
    stored = Rows(torch.tensor([1.0, 2.0, 3.0]), [2, 1])
    with pytest.raises(OpError, match=r"changed its input\(s\) \['tokens'\] in place.*rows.flat.clone"):
        inv.call(plan.op("changes_its_rows"), step=0, chunk=0, rows=[0, 1], is_padding=[False] * 2,
                 inputs={"tokens": stored})


@pytest.mark.parametrize("as_rows, message", [
    (["nope"], r"as_rows names 'nope', which is not among its inputs"),
    (["total"], r"as_rows names 'total' of type float32\[\]; only a per-sample numeric column of one ragged"),
    ({"a": 1}, r"as_rows= must be a list of names"),
])
def test_as_rows_names_only_ragged_inputs_of_one_dimension(as_rows, message):
    from rlgraph.errors import DeclarationError

    with pytest.raises(DeclarationError, match=message):
        op(outputs={"x": T.float32()}, group="w", as_rows=as_rows)(_takes_total)


def _takes_total(tokens: T.float32(R), total: T.float32()):
    return {"x": total}


def test_closing_an_invoker_closes_each_worker_class_once_and_goes_on_past_one_that_fails(caplog):
    # the end of a run (`GroupWorker.close`): every instance with a close(), the last made first; one that
    # raises is logged, and the others are closed still
    import sys
    from pathlib import Path

    from rlgraph.graph.loader import load_pipeline

    pipeline, ref = load_pipeline(str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py"))
    resources = sys.modules[pipeline.op("score").impl.split(":")[0]]
    plan = rlgraph.compile(pipeline.with_ops(resources.closing_score), ["trainer.seed=424242"], pipeline_ref=ref)
    inv = Invoker(plan, "reward", 0, 1)
    closed = []

    class Other:
        def close(self):
            closed.append("other")
            raise RuntimeError("its engine was gone already")

    inst = next(iter(inv.instances.values()))
    inst.close = lambda: closed.append("scorer")
    inv.instances["later:Other"] = Other()
    inv.instances["no_close:Plain"] = object()
    with caplog.at_level("WARNING", logger="rlgraph.runtime"):
        inv.close()
    assert closed == ["other", "scorer"] and inv.instances == {}
    assert "closing later:Other (group reward, rank 0) failed: RuntimeError: its engine was gone already" in caplog.text
    inv.close()  # closed already: nothing is closed twice
    assert closed == ["other", "scorer"]
