"""Bad input (issue 7, item 4): each case gives a typed `RLGraphError` whose message names the
culprit (file, row, field, key) and the fix, through the Python API and through the CLI (exit 1,
the message on stderr, no traceback). docs/troubleshooting.md lists the same cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from rlgraph.cli import cli  # noqa: E402
from rlgraph.errors import ConfigError, PipelineError, PlanError, RLGraphError  # noqa: E402
from rlgraph.graph.compile import compile_pipeline  # noqa: E402
from rlgraph.graph.loader import load_pipeline  # noqa: E402
from rlgraph.graph.plan import load_plan  # noqa: E402
from rlgraph.ops.data.prompts import PromptDataError, PromptSource, PromptTooLongError  # noqa: E402
from rlgraph.runtime.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, latest_checkpoint,  # noqa: E402
                                        load_state, read_meta, save_state)

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "tests" / "resources" / "grpo_pinned.py")
RLGRAPH = str(Path(sys.executable).with_name("rlgraph"))

GOOD_ROW = {"prompt": [{"role": "user", "content": "3+4="}], "data_source": "add",
            "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 0}}


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def user_error(result, *fragments: str) -> str:
    """Exit 1, every fragment on stderr, and no traceback anywhere."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in result.stderr, result.stderr
    return result.stderr


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------ data files

DATA_CASES = {
    "empty prompt string": ({**GOOD_ROW, "prompt": ""}, "row 1: empty prompt (no message has any content)"),
    "blank message": ({**GOOD_ROW, "prompt": [{"role": "user", "content": "  "}]},
                      "row 1: empty prompt (no message has any content)"),
    "empty message list": ({**GOOD_ROW, "prompt": []}, "row 1: empty prompt (no messages)"),
    "missing prompt": ({k: v for k, v in GOOD_ROW.items() if k != "prompt"}, "row 1: missing 'prompt'"),
    "missing ground truth": ({**GOOD_ROW, "reward_model": {"style": "rule"}},
                             "row 1: missing 'reward_model.ground_truth'"),
    "reward_model not a dict": ({**GOOD_ROW, "reward_model": "7"},
                                "row 1: 'reward_model' is '7', not a dict"),
    # (Ray Data, which reads the file when Ray runs in the process, fills the missing key with None)
    "message without content": ({**GOOD_ROW, "prompt": [{"role": "user"}]},
                                "row 1: message 0 of 'prompt' is {'role': 'user'"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_prompt_row_names_file_row_field_and_fix(tmp_path, case):
    row, expected = DATA_CASES[case]
    path = _jsonl(tmp_path / "prompts.jsonl", [GOOD_ROW, row])
    with pytest.raises(PromptDataError) as info:
        PromptSource({"tokenizer": "char", "path": path}, seed=0)
    msg = str(info.value)
    assert isinstance(info.value, RLGraphError)
    assert msg.startswith(f"{path}: 1 row(s) do not follow verl's layout"), msg
    assert expected in msg, msg
    assert "row 0" not in msg  # the good row is not blamed
    assert "\nfix: correct or remove these rows" in msg


def test_overlong_prompt_with_filtering_off_names_row_length_and_limit(tmp_path):
    long_row = {**GOOD_ROW, "prompt": [{"role": "user", "content": "1+2+3+4+5+6+7+8+9="}]}
    path = _jsonl(tmp_path / "prompts.jsonl", [GOOD_ROW, long_row])
    lengths = [len(r) for r in PromptSource({"tokenizer": "char", "path": path, "shuffle": False}, 0).next_batch(2)["prompt_ids"]]
    limit = lengths[0]
    with pytest.raises(PromptTooLongError) as info:
        PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": limit, "filter_overlong_prompts": False}, seed=0)
    msg = str(info.value)
    assert f"{path}: 1 prompt(s) are longer than data.max_prompt_length={limit}" in msg
    assert f"row 1: {lengths[1]} tokens" in msg and "row 0" not in msg
    assert "fix: raise data.max_prompt_length, or set data.filter_overlong_prompts=true" in msg
    # filtering on: dropped with a warning; every row too long: an error saying what to raise
    with pytest.warns(UserWarning, match="dropped 1 of 2 prompts"):
        assert PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": limit}, seed=0).num_rows == 1
    with pytest.raises(PromptTooLongError, match=r"all 2 prompts are longer than data.max_prompt_length=1 tokens; "
                                                 r"raise data.max_prompt_length"):
        PromptSource({"tokenizer": "char", "path": path, "max_prompt_length": 1}, seed=0)


def test_prompt_the_tokenizer_rejects_names_the_row(tmp_path, monkeypatch):
    from rlgraph.ops import models

    real = models.char_tokenizer()

    class Picky:
        """A tokenizer whose chat template refuses the role 'tool', as some templates do."""

        def apply_chat_template(self, conversations, **kw):
            for messages in conversations:
                if any(m["role"] == "tool" for m in messages):
                    raise ValueError("role 'tool' is not supported by this template")
            return real.apply_chat_template(conversations, **kw)

        def __call__(self, texts, **kw):
            return real(texts, **kw)

    from rlgraph.ops.data import prompts

    monkeypatch.setattr(prompts, "tokenizer_at", lambda path: Picky())
    rows = [GOOD_ROW, GOOD_ROW, {**GOOD_ROW, "prompt": [{"role": "tool", "content": "1+1="}]}]
    path = _jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(PromptDataError, match=r"prompts.jsonl: row 2: the tokenizer cannot encode its prompt "
                                              r"(.|\n)*role 'tool' is not supported(.|\n)*\nfix: give messages the "
                                              r"chat template accepts"):
        PromptSource({"tokenizer": "char", "path": path}, seed=0)


def test_a_damaged_source_position_is_a_typed_error(tmp_path):
    src = PromptSource({"tokenizer": "char", "path": _jsonl(tmp_path / "p.jsonl", [GOOD_ROW])}, seed=0)
    for state in ({"epoch": "x", "offset": 0}, {"offset": 0}, None):
        with pytest.raises(PromptDataError, match=r"saved position .* is not \{'epoch': int"):
            src.load_state_dict(state)
    with pytest.raises(PromptDataError, match=r"cannot resume the prompt source at epoch=0, offset=5"):
        src.load_state_dict({"epoch": 0, "offset": 5})


@pytest.mark.ray
@pytest.mark.slow
def test_cli_run_with_bad_prompt_rows_exits_1_with_the_rows(tmp_path):
    rows = [GOOD_ROW] * 4 + [{**GOOD_ROW, "prompt": []}, {"data_source": "add", "reward_model": {}}]
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # the example (its prepare hook builds the tiny model): the head of the file is read right after it,
    # while the workers' processes start, before the run waits for anything (`PromptSource.preflight`)
    res = subprocess.run([RLGRAPH, "run", str(ROOT / "examples" / "grpo.py"), "-o", str(tmp_path / "run"),
                          "--steps", "1", f"data.path={path}",
                          "--dataplane", "ray"], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr[res.stderr.rindex("Error: "):]
    assert err.startswith(f"Error: data.path {path!r} (first 6 rows): 2 row(s) do not follow verl's layout"), err
    assert "rlgraph: workers:" not in res.stderr  # found before the run waited for its workers
    assert "row 4: empty prompt (no messages)" in err
    assert "row 5: missing 'prompt', 'reward_model.ground_truth'" in err
    assert "fix: correct or remove these rows" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------- plans


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("plan")
    assert invoke("compile", GRPO, "-o", str(out)).exit_code == 0
    return (out / "plan.json").read_text()


def _edit(text: str, **changes) -> str:
    raw = json.loads(text)
    for k, v in changes.items():
        if v is ...:
            raw.pop(k)
        else:
            raw[k] = v
    return json.dumps(raw)


PLAN_CASES = {
    "newer version": (lambda t: _edit(t, version=3),
                      "is plan format version 3, but this rlgraph reads version 2; recompile the pipeline"),
    "older version": (lambda t: _edit(t, version=1),
                      "is plan format version 1, but this rlgraph reads version 2; recompile the pipeline"),
    "version as text": (lambda t: _edit(t, version="2"), "is plan format version '2', but this rlgraph reads version 2"),
    "no version": (lambda t: _edit(t, version=...), "has no plan format version, but this rlgraph reads version 2"),
    "other format": (lambda t: _edit(t, format="verl.config"),
                     "is not an rlgraph plan (no \"format\": \"rlgraph.plan\"); pass a plan.json written by "
                     "`rlgraph compile` (its format is 'verl.config')"),
    "a checkpoint's meta.json": (lambda t: json.dumps({"format": CHECKPOINT_FORMAT, "step": 3}),
                                 "(it is a checkpoint's meta.json)"),
    "some other JSON": (lambda t: json.dumps({"model": "x", "lr": 1}),
                        "(it has no \"format\" key; its keys are 'lr', 'model')"),
    "a JSON list": (lambda t: "[1, 2]", "(it holds a JSON list, not an object)"),
    "truncated": (lambda t: t[: len(t) // 2], "is not valid JSON (line "),
    "empty": (lambda t: "", "is not valid JSON (line 1, column 1: Expecting value) (the file is empty)"),
    "binary": (lambda t: b"\x80\x04\x95 not text", "is not a text file (byte 0 is not UTF-8), so not a plan.json"),
    "schema violation": (lambda t: _edit(t, batch="lots"), "is a malformed plan: batch: "),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_bad_plan_file_api_and_cli(plan_text, tmp_path, case):
    make, expected = PLAN_CASES[case]
    path = tmp_path / "plan.json"
    content = make(plan_text)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(info.value).startswith(repr(str(path))) and expected in str(info.value), str(info.value)
    assert info.value.__cause__ is None
    for command in (["describe", str(path)], ["viz", str(path), "-o", str(tmp_path / "x.dot")],
                    ["run", str(path), "-o", str(tmp_path / "run")]):  # run fails before Ray starts
        user_error(invoke(*command), "Error: ", expected)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------- overrides

OVERRIDE_CASES = {
    "data.batch_size=abc": "override data.batch_size=abc: expected an int, got 'abc'",
    "trainer.steps=1.5": "override trainer.steps=1.5: expected an int, got '1.5'",
    "actor.lr=fast": "override actor.lr=fast: expected a float, got 'fast'",
    "actor.lr=nan": "override actor.lr=nan: expected a finite float, got 'nan'",
    "trainer.steps=0": "override trainer.steps=0: 0 is below the minimum 1",
    "data.shuffle=maybe": "override data.shuffle=maybe: expected a bool (true/false), got 'maybe'",
}


@pytest.fixture(scope="module")
def grpo():
    return load_pipeline(GRPO)[0]


@pytest.mark.parametrize("item", sorted(OVERRIDE_CASES))
def test_override_of_the_wrong_type_api_and_cli(grpo, item, tmp_path):
    key = item.split("=")[0]
    with pytest.raises(PipelineError) as info:
        compile_pipeline(grpo, [item])
    assert info.value.codes == ["config-type"]
    assert OVERRIDE_CASES[item] in str(info.value)
    assert f"fix: write {key}=" in str(info.value)
    for command in ("validate", "describe"):
        user_error(invoke(command, GRPO, item), "[config-type]", OVERRIDE_CASES[item], f"fix: write {key}=")
    user_error(invoke("compile", GRPO, item, "-o", str(tmp_path / "out")), OVERRIDE_CASES[item])
    assert not (tmp_path / "out").exists()


def test_typed_overrides_from_python_are_checked_too(grpo):
    with pytest.raises(PipelineError, match=r"trainer.steps=1.5: expected int, got float 1.5(.|\n)*fix: write "
                                            r"trainer.steps=<int>"):
        compile_pipeline(grpo, {"trainer.steps": 1.5})
    with pytest.raises(PipelineError, match=r"actor.lr=inf: expected a finite float, got inf"):
        compile_pipeline(grpo, {"actor.lr": float("inf")})
    with pytest.raises(ConfigError, match=r"config override 3 \(int\) is not a 'key=value' string"):
        compile_pipeline(grpo, ["trainer.steps=2", 3])
    with pytest.raises(ConfigError, match=r"config override 'actor.lr' is not of the form key=value; write e.g."):
        compile_pipeline(grpo, ["actor.lr"])
    # on the command line a malformed item is bad usage: exit 2
    res = invoke("validate", GRPO, "actor.lr")
    assert res.exit_code == 2 and "is not of the form key=value" in res.stderr


def test_several_bad_overrides_are_reported_at_once(grpo):
    res = invoke("validate", GRPO, "data.batch_size=abc", "trainer.steps=1.5", "actorr.lr=1")
    err = user_error(res, "has 3 problems", "data.batch_size=abc", "trainer.steps=1.5", "config-unknown-key")
    assert "did you mean 'actor.lr'" in err


# -------------------------------------------------------------------------------- reward function


def test_reward_function_with_the_wrong_signature(tmp_path):
    from rlgraph.ops.reward.functions import RewardFnError, load_reward_fn

    (tmp_path / "my_reward.py").write_text("def f(x):\n    return 1.0\n")
    ref = f"{tmp_path / 'my_reward.py'}:f"
    with pytest.raises(RewardFnError) as info:
        load_reward_fn(ref)
    msg = str(info.value)
    assert isinstance(info.value, RLGraphError)
    assert repr(ref) in msg and "(x)" in msg  # names the function and shows its signature
    assert "data_source" in msg and "solution_str" in msg and "ground_truth" in msg  # and the one to write


# ----------------------------------------------------------------------------------- checkpoints


def _checkpoint(root: Path, step: int, meta: str | None = None) -> Path:
    d = root / "checkpoints" / f"step_{step}"
    save_state({"w": __import__("torch").ones(2), "k": 1}, d, "actor_0")
    (d / "meta.json").write_text(meta if meta is not None else
                                 json.dumps({"format": CHECKPOINT_FORMAT, "step": step, "pipeline": "grpo"}))
    return d


CHECKPOINT_META_CASES = {
    "corrupt": ('{"format": "rlgraph.checkp', "is not valid JSON"),
    "binary": ("\udcff", "is not valid JSON (UnicodeDecodeError"),
    "other version": (json.dumps({"format": "rlgraph.checkpoint.v1", "step": 3}),
                      "is checkpoint format 'rlgraph.checkpoint.v1', but this rlgraph reads 'rlgraph.checkpoint.v2'; "
                      "resume it with the rlgraph that wrote it, or move away"),
    "no format": (json.dumps({"step": 3}), "is checkpoint format None, but this rlgraph reads"),
    "not an object": ("[3]", "holds a JSON list, not the checkpoint's metadata object"),
    "no step": (json.dumps({"format": CHECKPOINT_FORMAT}), "has no valid step number (\"step\": None)"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_META_CASES))
def test_damaged_or_foreign_checkpoint_meta(tmp_path, case):
    meta, expected = CHECKPOINT_META_CASES[case]
    _checkpoint(tmp_path, 1)
    d = tmp_path / "checkpoints" / "step_3"
    d.mkdir(parents=True)
    (d / "meta.json").write_bytes(meta.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path)  # what `rlgraph run --resume` calls first
    msg = str(info.value)
    assert "step_3" in msg and "meta.json" in msg and expected in msg, msg
    assert "to resume from an earlier checkpoint, or run without --resume" in msg
    with pytest.raises(CheckpointError):
        read_meta(d)
    # the advice works: without the damaged one, the previous checkpoint is found
    import shutil

    shutil.rmtree(d)
    assert latest_checkpoint(tmp_path).name == "step_1"


def test_damaged_checkpoint_state_files(tmp_path):
    d = _checkpoint(tmp_path, 1)
    assert load_state(d, "actor_0")["k"] == 1
    (d / "actor_0.safetensors").write_bytes(b"\x00\x01 not safetensors")
    with pytest.raises(CheckpointError, match=r"actor_0.safetensors' is not a valid safetensors file .*delete "):
        load_state(d, "actor_0")
    d = _checkpoint(tmp_path, 2)
    (d / "actor_0.json").write_text('{"__dict__": {"w": {"__tensor__": "w"')
    with pytest.raises(CheckpointError, match=r"actor_0.json' is not valid JSON"):
        load_state(d, "actor_0")
    d = _checkpoint(tmp_path, 3)
    (d / "actor_0.json").write_text(json.dumps({"__dict__": {"w": {"__tensor__": "other"}}}))
    with pytest.raises(CheckpointError, match=r"refers to tensor 'other', which actor_0.safetensors does not hold"):
        load_state(d, "actor_0")
    (d / "actor_0.json").write_text(json.dumps({"__float__": "os.system"}))
    with pytest.raises(CheckpointError, match=r"actor_0.json' is malformed \(ValueError"):
        load_state(d, "actor_0")
    with pytest.raises(CheckpointError, match=r"has no state 'critic_0' \(critic_0.json is missing\); it was written "
                                              r"by another pipeline or plan"):
        load_state(d, "critic_0")
