"""The built-in tasks and the prompt source: verl's layout, checks, order, resume, Ray Data."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import pytest  # noqa: E402
import torch  # noqa: E402

from rlgraph.errors import RLGraphError  # noqa: E402
from rlgraph.ops import models, stages  # noqa: E402
from rlgraph.ops.data import tasks  # noqa: E402
from rlgraph.ops.data.prompts import PromptDataError, PromptSource, PromptTooLongError, read_table_rows  # noqa: E402

# ---------------------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_task_rows_follow_verls_layout_and_have_correct_answers(name):
    rows = tasks.make_rows(name, 50, seed=0)
    assert rows == tasks.make_rows(name, 50, seed=0)  # deterministic
    assert rows != tasks.make_rows(name, 50, seed=1)
    for i, r in enumerate(rows):
        assert set(r) == {"prompt", "data_source", "reward_model", "extra_info"}
        assert r["data_source"] == name and r["prompt"][0]["role"] == "user"
        assert r["extra_info"]["index"] == i and r["extra_info"]["split"] == "train"
        info, gt, content = r["extra_info"], r["reward_model"]["ground_truth"], r["prompt"][0]["content"]
        if name == "add":
            assert content == f"{info['a']}+{info['b']}=" and gt == str(info["a"] + info["b"]) and len(gt) <= 2
        elif name == "count":
            assert gt == str(info["word"].count(info["letter"])) and len(gt) == 1
        elif name == "mul":
            assert content == f"{info['a']}*{info['b']}=" and gt == str(info["a"] * info["b"])
            assert 10 <= info["a"] <= 99 and 2 <= info["b"] <= 9
        else:  # guess: the hidden digit is the ground truth, never in the prompt
            assert name == "guess" and gt in "123456789" and len(gt) == 1
            assert content == f"guess {info['game']}:"
        assert set(content + gt) <= set(tasks.TASKS[name].chars)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_train_and_test_prompts_are_disjoint(name):
    train = {r["prompt"][0]["content"] for r in tasks.make_rows(name, 500, seed=0)}
    test = {r["prompt"][0]["content"] for r in tasks.make_rows(name, 100, seed=0, split="test")}
    assert train and test and not train & test


def test_task_names_agree_with_the_stage_and_the_scorer():
    from rlgraph.ops.reward import functions as rewards

    assert set(stages.prompt_source().params["task"].choices) == set(tasks.TASKS)
    for name in tasks.TASKS:
        rewards.compute_score(name, "1", "1")  # a scorer exists


def test_write_task_round_trips_parquet_and_jsonl(tmp_path):
    rows = tasks.make_rows("count", 20, seed=0)
    for ext in ("parquet", "jsonl"):
        path = tasks.write_task("count", tmp_path / f"c.{ext}", 20, seed=0)
        assert read_table_rows(path, reader="local") == rows
    with pytest.raises(ValueError, match="use a .parquet or .jsonl"):
        tasks.write_task("count", tmp_path / "c.csv", 2)
    with pytest.raises(ValueError, match="unknown task 'nope'; the built-in tasks are add, count, guess, mul"):
        tasks.make_rows("nope", 2)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _batches_equal(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(x, y) for x, y in zip(a["prompt_ids"], b["prompt_ids"]))
    assert [a[k] for k in ("data_source", "ground_truth", "extra_info")] == \
           [b[k] for k in ("data_source", "ground_truth", "extra_info")]


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_next_batch_returns_tokenised_prompts(tmp_path, ext):
    path = tasks.write_task("count", tmp_path / f"p.{ext}", 10, seed=0)
    rows = read_table_rows(path, reader="local")
    src = PromptSource({"tokenizer": "char", "path": str(path), "shuffle": False}, seed=0)
    batch = src.next_batch(4)
    assert set(batch) == {"prompt_ids", "data_source", "ground_truth", "extra_info"}
    tok = models.char_tokenizer()
    for i in range(4):
        ids = batch["prompt_ids"][i]
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.tolist() == models.encode_prompt(tok, rows[i]["prompt"])
        assert batch["ground_truth"][i] == rows[i]["reward_model"]["ground_truth"]
        assert batch["extra_info"][i] == rows[i]["extra_info"]
    assert batch["data_source"] == ["count"] * 4


def test_tokenizer_param_loads_the_models_tokenizer(tmp_path):
    model_dir = tmp_path / "tok"
    models.char_tokenizer().save_pretrained(model_dir)
    a = PromptSource({"tokenizer": str(model_dir), "shuffle": False, "num_rows": 8}, seed=0).next_batch(8)
    b = PromptSource({"tokenizer": "char", "shuffle": False, "num_rows": 8}, seed=0).next_batch(8)
    _batches_equal(a, b)


def test_the_default_tokenizer_is_the_policys_own(tmp_path):
    """data.tokenizer empty: actor.model_path's tokenizer, not the character one. A policy whose
    tokenizer knows only digits, '+' and '=' encodes the task's other characters as <unk>, so the
    ids differ from the character tokenizer's and the unknown tokens are counted."""
    model_dir = tmp_path / "policy"
    models.char_tokenizer("0123456789+=").save_pretrained(model_dir)
    config = {"shuffle": False, "num_rows": 8, "task": "count"}
    with pytest.warns(UserWarning, match=r"prompt token\(s\) in 8 row\(s\) \(first: row 0\) are characters the "
                                         r"tokenizer '.*policy' does not know, encoded as '<unk>'"):
        own = PromptSource(config, seed=0, plan_config={"actor": {"model_path": str(model_dir)}})
    assert own.tokenizer_path == str(model_dir) and own.num_unknown > 0
    char = PromptSource({**config, "tokenizer": "char"}, seed=0)
    assert char.num_unknown == 0
    a, b = own.next_batch(4), char.next_batch(4)
    assert any(x.tolist() != y.tolist() for x, y in zip(a["prompt_ids"], b["prompt_ids"]))
    unk = own.tokenizer.unk_token_id
    assert own.batch_metrics() == {"unknown_tokens": float(sum((x == unk).sum().item() for x in a["prompt_ids"]))}
    assert char.batch_metrics() == {"unknown_tokens": 0.0}


def test_no_tokenizer_anywhere_is_an_error_naming_both_keys():
    with pytest.raises(PromptDataError, match=r"^data\.tokenizer is empty and the pipeline has no actor\.model_path"):
        PromptSource({"num_rows": 8}, seed=0)
    with pytest.raises(PromptDataError, match=r"data\.tokenizer=char"):
        PromptSource({"num_rows": 8}, seed=0, plan_config={"actor": {"model_path": ""}})


def test_epochs_are_seeded_permutations_and_batches_wrap(tmp_path):
    path = _write(tmp_path / "p.jsonl", tasks.make_rows("add", 10, seed=0))
    src = PromptSource({"tokenizer": "char", "path": path}, seed=7)
    first = [t.tolist() for t in src.next_batch(10)["prompt_ids"]]
    assert src.state_dict()["epoch"] == 0
    spanning = src.next_batch(13)  # 10 of epoch 1, then 3 of epoch 2
    assert src.state_dict() == {"epoch": 2, "offset": 3, "val_offset": 0}
    second = [t.tolist() for t in spanning["prompt_ids"][:10]]
    assert sorted(first) == sorted(second) and first != second  # same rows, new order
    again = PromptSource({"tokenizer": "char", "path": path}, seed=7)
    assert [t.tolist() for t in again.next_batch(10)["prompt_ids"]] == first
    other = PromptSource({"tokenizer": "char", "path": path}, seed=8)
    assert [t.tolist() for t in other.next_batch(10)["prompt_ids"]] != first
    in_order = PromptSource({"tokenizer": "char", "path": path, "shuffle": False}, seed=7).next_batch(20)
    assert in_order["extra_info"][10]["index"] == 0 and [e["index"] for e in in_order["extra_info"][:10]] == \
           list(range(10))


def test_state_dict_resumes_exactly(tmp_path):
    path = _write(tmp_path / "p.jsonl", tasks.make_rows("count", 11, seed=0))
    src = PromptSource({"tokenizer": "char", "path": path}, seed=1)
    for _ in range(3):
        src.next_batch(4)  # 12 rows: runs into the second epoch
    state = json.loads(json.dumps(src.state_dict()))  # JSON-able
    expected = [src.next_batch(4) for _ in range(2)]
    fresh = PromptSource({"tokenizer": "char", "path": path}, seed=1)
    fresh.load_state_dict(state)
    for want, got in zip(expected, [fresh.next_batch(4) for _ in range(2)]):
        _batches_equal(want, got)
    with pytest.raises(PromptDataError, match="offset=99: this data has 11 prompts per epoch"):
        fresh.load_state_dict({"epoch": 0, "offset": 99})


def test_validation_reads_in_order_and_wraps(tmp_path):
    train = _write(tmp_path / "t.jsonl", tasks.make_rows("add", 4, seed=0))
    val_rows = tasks.make_rows("add", 3, seed=0, split="test")
    val = _write(tmp_path / "v.jsonl", val_rows)
    src = PromptSource({"tokenizer": "char", "path": train, "val_path": val}, seed=0)
    got = src.next_val_batch(2)["ground_truth"] + src.next_val_batch(2)["ground_truth"]
    assert got == [val_rows[i % 3]["reward_model"]["ground_truth"] for i in range(4)]
    with pytest.raises(PromptDataError, match="validation needs data.val_path"):
        PromptSource({"tokenizer": "char", "path": train}, seed=0).next_val_batch(2)


def test_empty_path_generates_the_task_with_a_held_out_split():
    src = PromptSource({"tokenizer": "char", "task": "count", "num_rows": 16, "num_val_rows": 8}, seed=0)
    assert src.num_rows == 16
    train = src.next_batch(16)
    val = src.next_val_batch(8)
    assert set(train["data_source"]) == {"count"}
    assert {e["split"] for e in val["extra_info"]} == {"test"}


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    rows = tasks.make_rows("count", 30, seed=0)
    lengths = [len(models.encode_prompt(models.char_tokenizer(), r["prompt"])) for r in rows]
    limit = sorted(lengths)[15]
    path = _write(tmp_path / "p.jsonl", rows)
    with pytest.warns(UserWarning, match=rf"dropped {sum(n > limit for n in lengths)} of 30 prompts longer"):
        src = PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": limit}, seed=0)
    assert src.num_filtered == sum(n > limit for n in lengths)
    assert src.num_rows == 30 - src.num_filtered
    assert max(len(t) for t in src.next_batch(src.num_rows)["prompt_ids"]) <= limit
    first = lengths.index(max(lengths))
    with pytest.raises(PromptTooLongError, match=rf"longer than data.max_prompt_length={limit}:\n(.|\n)*"
                                                 rf"row {first}: {lengths[first]} tokens(.|\n)*"
                                                 r"fix: raise data.max_prompt_length, or set "
                                                 r"data.filter_overlong_prompts=true"):
        PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": limit, "filter_overlong_prompts": False}, seed=0)
    with pytest.raises(PromptTooLongError, match="all 30 prompts are longer than data.max_prompt_length=3"):
        PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": 3}, seed=0)


@pytest.fixture
def no_ray(monkeypatch):
    """As in a script without Ray, also when an earlier test left the session's Ray running:
    ``reader=auto`` reads locally (Ray Data needs one schema for all rows)."""
    from rlgraph.ops.data import prompts as data

    monkeypatch.setattr(data, "_ray_initialized", lambda: False)


def test_bad_rows_are_reported_together_with_the_fix(tmp_path, no_ray):
    good = tasks.make_rows("add", 1, seed=0)[0]
    rows = [
        good,
        {**good, "prompt": [{"role": "user", "content": "  "}]},
        {**good, "reward_model": {"style": "rule"}},
        {**good, "prompt": [{"role": "user"}]},
        {**good, "data_source": None},
        {**good, "extra_info": [1, 2]},
        {**good, "prompt": "5+5="},  # a plain string is one user message: fine
        {**good, "reward_model": {"ground_truth": 12}, "extra_info": None},  # numbers become strings
    ]
    path = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(PromptDataError) as e:
        PromptSource({"tokenizer": "char", "path": path}, seed=0)
    msg = str(e.value)
    assert "5 row(s) do not follow verl's layout" in msg
    assert "row 1: empty prompt" in msg
    assert "row 2: missing 'reward_model.ground_truth'" in msg
    assert "row 3: message 0 of 'prompt'" in msg and "needs a string 'role' and 'content'" in msg
    assert "row 4: missing 'data_source'" in msg
    assert "row 5: 'extra_info' is a list" in msg
    assert "row 6" not in msg and "row 7" not in msg
    ok = PromptSource({"tokenizer": "char", "path": _write(tmp_path / "ok.jsonl", [rows[0], rows[6], rows[7]]), "shuffle": False}, 0)
    b = ok.next_batch(3)
    assert b["ground_truth"][2] == "12" and b["extra_info"][2] == {}
    assert issubclass(PromptDataError, RLGraphError)


def test_file_errors(tmp_path, no_ray):
    with pytest.raises(PromptDataError, match="prompt file '.*nope.parquet' does not exist"):
        PromptSource({"tokenizer": "char", "path": str(tmp_path / "nope.parquet")}, seed=0)
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(PromptDataError, match="has extension '.csv'; use .parquet or .jsonl"):
        PromptSource({"tokenizer": "char", "path": str(tmp_path / "p.csv")}, seed=0)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(PromptDataError, match="cannot read prompt file '.*bad.parquet' as parquet"):
        PromptSource({"tokenizer": "char", "path": str(tmp_path / "bad.parquet")}, seed=0)
    other = _write(tmp_path / "other.jsonl", [{"question": "1+1", "answer": "2"}])
    with pytest.raises(PromptDataError, match=r"has no 'prompt', 'data_source', 'reward_model' field in any row "
                                              r"\(it has \['answer', 'question'\]\)"):
        PromptSource({"tokenizer": "char", "path": other}, seed=0)
    with pytest.raises(PromptDataError, match="data.reader='ray' needs Ray initialised"):
        read_table_rows(tasks.write_task("add", tmp_path / "a.jsonl", 2), reader="ray")


# ---------------------------------------------------------------------------- with Ray running


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():  # another test module started it: use it, leave it running
        yield ray
        return
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the env var was set
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_ray_data_reads_the_same_rows_as_the_local_reader(ray_local, tmp_path):
    for ext in ("parquet", "jsonl"):
        path = tasks.write_task("count", tmp_path / f"c.{ext}", 40, seed=0)
        assert read_table_rows(path, reader="ray") == read_table_rows(path, reader="local")


@pytest.mark.ray
def test_auto_reader_skips_ray_data_when_no_cpu_is_free(ray_local, tmp_path, monkeypatch):
    from rlgraph.ops.data import prompts as data

    path = tasks.write_task("add", tmp_path / "a.parquet", 8, seed=0)
    calls = []
    monkeypatch.setattr(data, "_read_with_ray", lambda p, kind: calls.append(p))
    monkeypatch.setattr(data, "_ray_has_free_cpu", lambda: False)  # all CPUs held by worker groups
    assert read_table_rows(path) == read_table_rows(path, reader="local") and not calls
    monkeypatch.setattr(data, "_ray_has_free_cpu", lambda: True)
    read_table_rows(path)  # the fake Ray read returns None (timed out): the local reader reads instead
    assert calls


def test_preflight_reads_the_head_of_the_files_and_checks_the_tokenizer(tmp_path):
    """What `rlgraph validate` checks before anything starts."""
    rows = tasks.make_rows("add", 8, 0, "train")
    good = _write(tmp_path / "good.jsonl", rows)
    policy = tmp_path / "policy"
    models.char_tokenizer().save_pretrained(policy)
    plan_config = {"actor": {"model_path": str(policy)}}
    assert PromptSource.preflight({"path": good}, 0, plan_config) == []
    with pytest.raises(PromptDataError, match=r"prompt file '.*nope\.parquet' does not exist"):
        PromptSource.preflight({"path": str(tmp_path / "nope.parquet")}, 0, plan_config)
    no_gt = _write(tmp_path / "no_gt.jsonl", [{**r, "reward_model": {}} for r in rows])
    with pytest.raises(PromptDataError, match=r"data\.path '.*no_gt\.jsonl' \(first 8 rows\): 8 row\(s\) do not follow "
                                              r"verl's layout(.|\n)*row 0: missing 'reward_model\.ground_truth'"):
        PromptSource.preflight({"path": no_gt}, 0, plan_config)
    # the policy not built yet (its prepare hook makes it): the fields are still checked, the tokenizer noted
    later = {"actor": {"model_path": str(tmp_path / "not_yet")}}
    assert "does not exist yet" in PromptSource.preflight({"path": good}, 0, later)[0]
    with pytest.raises(PromptDataError, match=r"has no reward_model\.ground_truth in row\(s\) \[0, 1, 2, 3, 4\]"):
        PromptSource.preflight({"path": no_gt}, 0, later)
    with pytest.raises(PromptDataError, match=r"data\.tokenizer '.*missing' does not exist"):
        PromptSource.preflight({"tokenizer": str(tmp_path / "missing")}, 0, plan_config)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    policy = tmp_path / "policy"
    models.char_tokenizer("0123456789+=").save_pretrained(policy)  # 7 special tokens + 12 characters
    (policy / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 19}))
    plan_config = {"actor": {"model_path": str(policy)}}
    assert PromptSource.preflight({}, 0, plan_config) == []  # its own tokenizer fits
    with pytest.raises(PromptDataError, match=r"^data\.tokenizer 'char' has \d+ tokens, but the policy in "
                                              r"actor\.model_path '.*policy' has an embedding of 19 rows"):
        PromptSource.preflight({"tokenizer": "char"}, 0, plan_config)
