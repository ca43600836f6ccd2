"""Rule-based rewards: the built-in scorer, loading user functions, and batch scoring."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from rlgraph.errors import RLGraphError
from rlgraph.ops.data import tasks
from rlgraph.ops.reward import functions as rewards
from rlgraph.ops.reward.functions import (RewardFnError, UnknownDataSourceError, compute_score, load_reward_fn,
                                          score_batch)


@pytest.mark.parametrize("solution, expected", [
    ("7", 1.0),
    (" 7\n", 1.0),  # surrounding whitespace is not part of the answer
    ("7<eos><pad><pad>", 1.0),  # special tokens left in by decode(skip_special_tokens=False)
    ("7<|user|>9", 1.0),  # the model started a new turn: only its answer counts
    ("77", 0.0),
    ("7 is it", 0.0),
    ("8", 0.0),  # no partial credit for a near miss
    ("", 0.0),
    ("<eos>7", 0.0),
])
def test_compute_score_is_exact_match_of_the_parsed_answer(solution, expected):
    assert compute_score("add", solution, "7") == expected


def test_compute_score_accepts_extra_info_and_every_task():
    for name in tasks.TASKS:
        row = tasks.make_rows(name, 1, seed=0)[0]
        gt = row["reward_model"]["ground_truth"]
        assert compute_score(name, gt, gt, row["extra_info"]) == 1.0
        assert compute_score(data_source=name, solution_str=gt + "x", ground_truth=gt) == 0.0


def test_compute_score_names_the_known_data_sources():
    with pytest.raises(UnknownDataSourceError, match=r"no scorer for data_source='gsm8k'; it knows add, count.*"
                                                     r"reward.fn="):
        compute_score("gsm8k", "7", "7")
    assert issubclass(UnknownDataSourceError, RLGraphError)


def _module(tmp_path, monkeypatch, source: str, name: str = "my_rewards") -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_reward_fn_imports_the_builtin_and_user_functions(tmp_path, monkeypatch):
    assert load_reward_fn("rlgraph.ops.reward.functions:compute_score") is compute_score
    mod = _module(tmp_path, monkeypatch, """
        def score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

        def needs_extra(data_source, solution_str, ground_truth, extra_info):
            return 0.0

        def kwargs_style(data_source, solution_str, ground_truth, **kwargs):
            return 0.0
    """, "rewards_ok")
    assert load_reward_fn(f"{mod}:score")("d", "a", "a") == {"score": 1.0, "length": 1}
    load_reward_fn(f"{mod}:needs_extra")  # verl always passes extra_info, so no default is needed
    load_reward_fn(f"{mod}:kwargs_style")
    fn = load_reward_fn(f"{tmp_path / 'rewards_ok.py'}:score")  # a file path, as verl's custom_reward_function
    assert fn("d", "a", "b")["score"] == 0.0


def test_load_reward_fn_errors_name_the_problem_and_the_fix(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, """
        def three(data_source, solution_str, ground_truth):
            return 1.0

        def renamed(source, response, answer, extra_info=None):
            return 1.0

        NOT_A_FUNCTION = 3
    """, "rewards_bad")
    with pytest.raises(RewardFnError, match="not of the form 'module:function'"):
        load_reward_fn("rlgraph.ops.reward.functions")
    with pytest.raises(RewardFnError, match="cannot import 'no_such_module_xyz'"):
        load_reward_fn("no_such_module_xyz:score")
    with pytest.raises(RewardFnError, match="file 'missing.py' does not exist"):
        load_reward_fn("missing.py:score")
    with pytest.raises(RewardFnError, match="module 'rewards_bad' has no attribute 'nope'"):
        load_reward_fn(f"{mod}:nope")
    with pytest.raises(RewardFnError, match=r"is not callable \(int 3\)"):
        load_reward_fn(f"{mod}:NOT_A_FUNCTION")
    (tmp_path / "broken.py").write_text("def score(:\n")
    with pytest.raises(RewardFnError, match=r"cannot import .*broken.py.*SyntaxError"):
        load_reward_fn(f"{tmp_path / 'broken.py'}:score")
    with pytest.raises(RewardFnError, match=r"signature three\(data_source, solution_str, ground_truth\).*"
                                            r"extra_info=None\)"):
        load_reward_fn(f"{mod}:three")
    with pytest.raises(RewardFnError, match=r"renamed\(source, response, answer.*Fix: define it as"):
        load_reward_fn(f"{mod}:renamed")


def test_score_batch_normalises_float_and_dict_returns():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "dict":
            return {"score": 0.5, "acc": True, "pred": solution_str}
        if data_source == "tensor":
            return torch.tensor(2.0)
        return int(solution_str == ground_truth)  # ints and bools are scores too

    scores, extras = score_batch(fn, ["plain", "dict", "tensor", "plain"], ["a", "b", "c", "x"],
                                 ["a", "b", "c", "y"], [None, {"i": 1}, None, None])
    assert scores == [1.0, 0.5, 2.0, 0.0] and all(isinstance(s, float) for s in scores)
    assert extras == [{}, {"acc": True, "pred": "b"}, {}, {}]
    assert score_batch(compute_score, ["add"], ["7<eos>"], ["7"]) == ([1.0], [{}])  # extra_infos optional
    assert score_batch(compute_score, [], [], [], []) == ([], [])


def test_score_batch_errors_name_the_sample():
    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    def text(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0"

    def nan(data_source, solution_str, ground_truth, extra_info=None):
        return math.nan

    with pytest.raises(RewardFnError, match=r"sample 0 \(data_source='add'\) returned a dict without 'score' "
                                            r"\(keys \['acc'\]\)"):
        score_batch(no_score, ["add"], ["7"], ["7"], [None])
    with pytest.raises(RewardFnError, match="returned str '1.0'; return a float"):
        score_batch(text, ["add"], ["7"], ["7"], [None])
    with pytest.raises(RewardFnError, match="non-finite score nan"):
        score_batch(nan, ["add"], ["7"], ["7"], [None])
    with pytest.raises(RewardFnError, match="lists of different lengths"):
        score_batch(compute_score, ["add", "add"], ["7"], ["7", "8"], [None, None])


def test_parse_answer():
    assert rewards.parse_answer("  12<eos>") == "12"
    assert rewards.parse_answer("<pad>") == ""


def test_overlong_penalty_by_hand():
    """DAPO's soft overlong punishment, max length 8, buffer 4, factor 1: no penalty up to 4 tokens,
    then -(L - 4) / 4: L=6 -> -0.5, L=8 -> -1. On the last response token, added to the score."""
    from types import SimpleNamespace

    import torch

    from rlgraph.ops.reward.rule import overlong_penalties, overlong_penalty

    torch.testing.assert_close(overlong_penalties(torch.tensor([3, 4, 6, 8]), 8, 4, 1.0),
                               torch.tensor([0.0, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalties(torch.tensor([7]), 8, 4, 0.5), torch.tensor([-0.375]))
    lengths = [3, 6, 8, 0]  # the last row is padding
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    scores = torch.zeros(4, 8)
    scores[0, 2], scores[1, 5], scores[2, 7] = 1.0, 1.0, 0.0
    ctx = SimpleNamespace(op="overlong", is_padding=[False, False, False, True],
                          config={"rollout": {"max_new_tokens": 8}}, outputs=["token_level_scores", "overlong_metrics"])
    out = overlong_penalty(mask, score_column="rule_scores", buffer_len=4, penalty_factor=1.0, max_response_length=0,
                           ctx=ctx, rule_scores=scores)
    want = scores.clone()
    want[1, 5], want[2, 7] = 0.5, -1.0
    torch.testing.assert_close(out["token_level_scores"], want)
    assert out["overlong_metrics"] == pytest.approx({"penalised_frac": 2 / 3, "penalty_mean": -0.5})
    with pytest.raises(ValueError, match="buffer_len=9 must be between 1 and the maximum response length 8"):
        overlong_penalties(torch.tensor([3]), 8, 9, 1.0)


def test_filter_groups_by_hand():
    """Dynamic sampling's filter: groups 0 and 2 score alike within themselves (std 0: dropped),
    group 1 varies (kept), group 3 has one sample (kept, as verl keeps it); padding is ignored.
    With metric_column the variance is read from another column than the score passed on."""
    from types import SimpleNamespace

    import torch

    from rlgraph.ops.reward.rule import filter_groups

    uid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 9])
    scores = torch.zeros(8, 3)
    scores[:, -1] = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    drops: list[tuple[int, str, bool]] = []
    ctx = SimpleNamespace(is_padding=[False] * 7 + [True], outputs=["token_level_scores", "filter_groups_metrics"],
                          drop=lambda i, reason, group=False: drops.append((i, reason, group)))
    out = filter_groups(uid, score_column="raw", metric_column="raw", min_std=0.0, ctx=ctx, raw=scores)
    assert drops == [(0, "zero_variance", True), (4, "zero_variance", True)]
    torch.testing.assert_close(out["token_level_scores"], scores)
    assert out["filter_groups_metrics"] == {"groups_count": 4, "kept_groups_count": 2, "dropped_groups_count": 2}
    # std of group 1 is 0.5: min_std=0.5 drops it too
    drops.clear()
    filter_groups(uid, score_column="raw", metric_column="raw", min_std=0.5, ctx=ctx, raw=scores)
    assert [d[0] for d in drops] == [0, 2, 4]
    # the variance of another column: group 0 differs there, group 1 does not
    other = torch.zeros(8, 3)
    other[:, 0] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    drops.clear()
    filter_groups(uid, score_column="raw", metric_column="acc", min_std=0.0, ctx=ctx, raw=scores, acc=other)
    assert [d[0] for d in drops] == [2, 4]
    # shaped scores such as 0.1 or -1/3 on every sample: alike, so dropped (a float32 std is about 1e-8 there)
    shaped = torch.zeros(8, 3)
    shaped[:, -1] = torch.tensor([0.1, 0.1, -1 / 3, -1 / 3, 0.6, 0.7, 1.0, 0.0])
    drops.clear()
    filter_groups(uid, score_column="raw", metric_column="raw", min_std=0.0, ctx=ctx, raw=shaped)
    assert [d[0] for d in drops] == [0, 2]


def test_the_rule_reward_worker_loads_its_tokenizer_at_setup_and_leaves_a_bad_one_to_its_call(tmp_path):
    # loaded beside the models at start-up, not in the first step (transformers' import takes seconds)
    from types import SimpleNamespace

    from rlgraph.ops.reward.rule import RewardWorker

    def ctx(config):
        return SimpleNamespace(op="reward", group="reward", rank=0, dp=1, step=-1, chunk=-1, seed=0, config=config)

    w = RewardWorker()
    w.setup(ctx({"data": {"tokenizer": "char"}}))
    assert list(w.tokenizers) == ["char"]
    w = RewardWorker()
    w.setup(ctx({"reward": {"tokenizer": "char"}, "actor": {"model_path": str(tmp_path / "none")}}))
    assert list(w.tokenizers) == ["char"]
    w = RewardWorker()  # a path without a tokenizer: setup passes, the op's call reports it
    w.setup(ctx({"actor": {"model_path": str(tmp_path / "none")}}))
    assert w.tokenizers == {}
    with pytest.raises(RLGraphError, match="none"):
        w._tokenizer("")


def test_the_rule_reward_puts_each_score_on_its_row_s_last_response_token():
    # rows of 3, 0 and 4 response tokens, a padding row, and a sample whose function raises (scored 0 with
    # on_error=zero): each score lands on its row's last real token, nothing anywhere else. The responses
    # come as their rows (the op takes them as_rows) and the scores go out as rows of the same lengths
    from types import SimpleNamespace

    from rlgraph.ops.models import char_tokenizer
    from rlgraph.ops.reward.rule import RewardWorker
    from rlgraph.rows import Rows, rows_of

    tok = char_tokenizer()
    texts, truths = ["12", "", "7", "4", "9"], ["12", "2", "7", "4", "8"]  # the 4th row is padding
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    rows[1] = []
    lengths = tuple(len(r) for r in rows)
    responses = rows_of([torch.tensor(r, dtype=torch.int64) for r in rows], torch.int64)
    ctx = SimpleNamespace(op="reward", lengths={"response_len": lengths}, is_padding=(False, False, False, True, False),
                          outputs=("token_level_scores", "reward_extra", "reward_metrics"), drop=None, chunks=(5,),
                          wanted=("token_level_scores", "reward_extra", "reward_metrics"))
    w = RewardWorker()
    w.default_tokenizer, w.tokenizers, w.scorers = "char", {}, {}
    out = w.compute_reward(responses, None, ["add"] * 5, truths, [None] * 5,
                           fn=f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd",
                           executor="thread", concurrency=2, timeout_s=10.0, on_error="zero", tokenizer="", ctx=ctx)
    expected = torch.zeros(5, max(lengths))
    expected[0, lengths[0] - 1] = 1.0  # "12" == "12"; row 1 has no token to carry its score
    expected[2, lengths[2] - 1] = 0.0  # ground truth 7 is odd: the function raised, scored 0
    expected[4, lengths[4] - 1] = 0.0  # "9" != "8"
    assert type(out["token_level_scores"]) is Rows and out["token_level_scores"].lengths == list(lengths)
    assert torch.equal(out["token_level_scores"].padded(), expected)
    # "4" == "4" on a padding row: never scored, so a row of zeros where a score of 1 would show
    assert "reward_error" in out["reward_extra"][2] and out["reward_extra"][3] == {}  # padding is never scored
    assert out["reward_metrics"]["scored_count"] == 4 and out["reward_metrics"]["error_count"] == 1
    ctx.wanted = ("token_level_scores", "reward_metrics")  # nobody reads the extras: an empty record a row
    unread = w.compute_reward(responses, None, ["add"] * 5, truths, [None] * 5,
                              fn=f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd",
                              executor="thread", concurrency=2, timeout_s=10.0, on_error="zero", tokenizer="",
                              ctx=ctx)
    assert unread["reward_extra"] == [{}] * 5 and torch.equal(unread["token_level_scores"].padded(), expected)
    assert unread["reward_metrics"] == out["reward_metrics"]
    # without a time limit the samples are scored on the caller's thread (from the second call, once the
    # function's cost is measured): the same scores, errors and extras
    # a stage of one's own may give the responses padded: the body takes them back to rows by their lengths
    padded_in = w.compute_reward(responses.padded(), None, ["add"] * 5, truths, [None] * 5,
                                 fn=f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd",
                                 executor="thread", concurrency=2, timeout_s=10.0, on_error="zero", tokenizer="",
                                 ctx=ctx)
    assert torch.equal(padded_in["token_level_scores"].padded(), expected)
    inline = [w.compute_reward(responses, None, ["add"] * 5, truths, [None] * 5,
                               fn=f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd",
                               executor="thread", concurrency=2, timeout_s=0.0, on_error="zero", tokenizer="",
                               ctx=ctx) for _ in range(2)][1]
    assert torch.equal(inline["token_level_scores"].padded(), expected)
    assert inline["reward_metrics"] == out["reward_metrics"]
    # every row real and none empty (the common case): the same scores on the same tokens
    keep = [0, 2, 4]
    ctx.is_padding, ctx.chunks = (False,) * 3, (3,)
    ctx.lengths = {"response_len": tuple(lengths[i] for i in keep)}
    plain = w.compute_reward(rows_of([torch.tensor(rows[i]) for i in keep], torch.int64), None, ["add"] * 3,
                             [truths[i] for i in keep], [None] * 3,
                             fn=f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd",
                             executor="thread", concurrency=2, timeout_s=0.0, on_error="zero", tokenizer="", ctx=ctx)
    assert torch.equal(plain["token_level_scores"].padded(), expected[keep])
    assert plain["reward_metrics"]["scored_count"] == 3 and plain["reward_metrics"]["error_count"] == 1
    # each row's sum comes with the rows (the worker's summaries read it) and is what summing the row gives,
    # padding, failed and empty rows included
    from rlgraph.runtime.worker import _row_sums

    for scored in (out, unread, padded_in, inline, plain):
        given = scored["token_level_scores"]
        assert given.sums is not None
        assert _row_sums(given) == _row_sums(Rows(given.flat, given.lengths)) == given.padded().double().sum(1).tolist()


def test_the_rule_reward_scores_a_call_of_several_chunks_as_one_call_per_chunk_would():
    # the op is vectorised: a call holding chunks of 3 and 4 rows decodes and scores them at once, and
    # gives one metrics record per chunk, each what a call on that chunk alone gives
    from types import SimpleNamespace

    from rlgraph.ops.models import char_tokenizer
    from rlgraph.ops.reward.rule import RewardWorker
    from rlgraph.rows import rows_of

    tok = char_tokenizer()
    texts = ["12", "7", "", "4", "9", "3", "5"]
    truths = ["12", "7", "2", "4", "8", "3", "6"]  # odd truths raise in raise_on_odd: rows 1, 5
    padding = (False, False, False, True, False, False, False)
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    rows[2] = []
    fn = f"{Path(__file__).parents[2] / 'resources' / 'reward_fns.py'}:raise_on_odd"
    w = RewardWorker()
    w.default_tokenizer, w.tokenizers, w.scorers = "char", {}, {}

    def call(lo, hi, chunks):
        part = rows[lo:hi]
        lengths = tuple(len(r) for r in part)
        responses = rows_of([torch.tensor(r, dtype=torch.int64) for r in part], torch.int64)
        ctx = SimpleNamespace(op="reward", lengths={"response_len": lengths}, is_padding=padding[lo:hi],
                              outputs=("token_level_scores", "reward_extra", "reward_metrics"), drop=None,
                              chunks=chunks, wanted=("token_level_scores", "reward_extra", "reward_metrics"))
        return w.compute_reward(responses, None, ["add"] * (hi - lo), truths[lo:hi], [None] * (hi - lo),
                                fn=fn, executor="thread", concurrency=2, timeout_s=10.0, on_error="zero",
                                tokenizer="", ctx=ctx)

    whole, first, second = call(0, 7, (3, 4)), call(0, 3, (3,)), call(3, 7, (4,))
    assert whole["reward_metrics"] == [first["reward_metrics"], second["reward_metrics"]]
    assert [m["scored_count"] for m in whole["reward_metrics"]] == [3, 3]
    assert [m["error_count"] for m in whole["reward_metrics"]] == [1, 1]
    assert torch.equal(whole["token_level_scores"].flat,
                       torch.cat([first["token_level_scores"].flat, second["token_level_scores"].flat]))
    assert whole["token_level_scores"].lengths == first["token_level_scores"].lengths + second["token_level_scores"].lengths
    assert whole["reward_extra"] == first["reward_extra"] + second["reward_extra"]
