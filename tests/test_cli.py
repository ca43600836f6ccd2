"""The `rlgraph` command line: exit codes, padding numbers in `describe`, files from `compile`.

Expected padding numbers are worked out here from the rule (BRIEF section 2), not read back
from the compiler: m = lcm(dp of every consuming group, actor_mini*n, critic_mini*n) and the
batch of batch_size*n samples is padded up to a multiple of m.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlgraph import __version__
from rlgraph.cli import cli
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.loader import load_pipeline
from rlgraph.graph.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
# the examples with fixed configs (tests/resources/pinned.py): their tuned defaults may change
PPO = str(ROOT / "tests" / "resources" / "ppo_pinned.py")
GRPO = str(ROOT / "tests" / "resources" / "grpo_pinned.py")

# The acceptance case: 45 prompts x 8 samples, actor and critic on 2 ranks, mini-batches of 15.
ACCEPTANCE = ["data.batch_size=45", "rollout.n=8", "groups.actor.dp=2", "groups.critic.dp=2",
              "actor.mini_batch_size=15", "critic.mini_batch_size=15"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def padding(output: str) -> tuple[int, int, int]:
    """(multiple, padded batch, pad rows) as printed by `describe`."""
    multiple = re.search(r"^multiple\s+lcm\([\d, ]+\) = (\d+)$", output, re.M)
    padded = re.search(r"^padded batch\s+(\d+) samples \((\d+) pad rows\)$", output, re.M)
    assert multiple and padded, output
    return int(multiple.group(1)), int(padded.group(1)), int(padded.group(2))


def ok(result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def user_error(result, *fragments: str) -> str:
    """Exit 1 with every fragment in stderr, and no traceback anywhere."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in result.stderr, result.stderr
    return result.stderr


def test_version():
    assert ok(invoke("--version")).strip() == f"rlgraph, version {__version__}"


# describe: the padding rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch_size, n, actor_dp, critic_dp, actor_mini, critic_mini, extra",
    [
        (45, 8, 2, 2, 15, 15, []),  # 360 is already a multiple of 120: no padding
        (45, 8, 2, 2, 16, 15, []),  # lcm(128, 120) = 1920: pads 360 -> 1920
        (45, 8, 4, 4, 15, 15, ["cluster.cpus_per_node=16"]),  # 8 ranks need more than 8 CPUs
        (45, 4, 4, 2, 15, 15, ["cluster.cpus_per_node=16"]),  # 180 -> lcm(4, 60) = 60: 180
        (10, 3, 4, 1, 3, 2, ["cluster.cpus_per_node=16"]),  # 30 -> lcm(4, 9, 6) = 36: 36
    ],
)
def test_describe_prints_the_padding_the_rule_gives(batch_size, n, actor_dp, critic_dp, actor_mini,
                                                    critic_mini, extra):
    out = ok(invoke("describe", PPO, f"data.batch_size={batch_size}", f"rollout.n={n}",
                    f"groups.actor.dp={actor_dp}", f"groups.critic.dp={critic_dp}",
                    f"actor.mini_batch_size={actor_mini}", f"critic.mini_batch_size={critic_mini}", *extra))
    # every group of the PPO example reads per-sample columns; reward and advantage have dp=1
    m = math.lcm(actor_dp, critic_dp, 1, 1, actor_mini * n, critic_mini * n)
    global_batch = batch_size * n
    padded = math.ceil(global_batch / m) * m
    assert padding(out) == (m, padded, padded - global_batch)
    assert f"{batch_size} prompts x n={n} = {global_batch} samples" in out
    # the update ops split the padded batch into padded / (mini * n) mini-batches
    assert f"{padded // (actor_mini * n)} mini-batches of {actor_mini * n} x 1 epoch" in out
    assert f"{padded // (critic_mini * n)} mini-batches of {critic_mini * n} x 1 epoch" in out


def test_acceptance_case_numbers():
    out = ok(invoke("describe", PPO, *ACCEPTANCE))
    assert padding(out) == (120, 360, 0)
    assert "lcm(2, 1, 2, 1, 120, 120) = 120" in out
    assert "update_actor: actor.mini_batch_size=15 x n=8" in out


def test_describe_shows_the_warmup_multiple_when_it_differs():
    args = ["describe", PPO, *ACCEPTANCE, "actor.mini_batch_size=16"]
    assert "during warm-up" not in ok(invoke(*args))  # no warm-up steps: nothing to show
    out = ok(invoke(*args, "trainer.critic_warmup=3"))
    # during warm-up the actor update is skipped, so its 16*8 term does not count
    m_warm = math.lcm(2, 2, 1, 1, 15 * 8)
    padded_warm = math.ceil(360 / m_warm) * m_warm
    assert padding(out) == (1920, 1920, 1560)
    assert (f"steps < 3: multiple {m_warm}, padded batch {padded_warm} samples "
            f"({padded_warm - 360} pad rows)") in out
    assert re.search(r"update_actor: actor\.mini_batch_size=16 x n=8\s+128\s+from step 3", out)
    assert re.search(r"update_actor .*barrier, from step 3", out)


def test_describe_shows_every_section_with_unfolded_headers():
    out = ok(invoke("describe", PPO, *ACCEPTANCE))
    for heading in ("ops", "columns", "worker groups", "padding terms", "schedule", "config"):
        assert re.search(rf"^{heading}$", out, re.M), heading
    header_row = next(line for line in out.splitlines() if line.lstrip().startswith("op "))
    assert header_row.split() == ["op", "group", "dp", "granularity", "mode", "stage", "inputs", "outputs",
                                  "concurrent", "with", "batching"]
    assert re.search(r"^ column\s+dtype\s+shape\s+level\s+kind\s+producer\s+consumers\s+stored$", out, re.M)
    assert re.search(r"^ group\s+dp\s+cpus/worker\s+gpus/worker\s+torch threads\s+pool\s+placement\s+colocated with"
                     r"\s+nodes\s+ops$", out, re.M)
    assert re.search(r"^ actor\s+2\s+1\s+0\s+1\s+actor\s+pack\s+-\s+node 0 x2\s+generate, old_logprob, ref, update_actor$",
                     out, re.M)
    assert re.search(r"^ entropy\s+float32\s+\[response_len\]\s+sample\s+data\s+old_logprob\s+-\s+no \(pruned\)$",
                     out, re.M)
    assert "critical path  data -> generate -> old_logprob -> advantage -> update_actor (cost 9.2)" in out
    assert re.search(r"^ data\.batch_size\s+45\s+override$", out, re.M)
    assert re.search(r"^ actor\.lr\s+0\.0001$", out, re.M)


def test_describe_is_deterministic_and_has_no_trailing_blanks():
    first = ok(invoke("describe", GRPO))
    assert first == ok(invoke("describe", GRPO))
    assert all(line == line.rstrip() for line in first.splitlines())


def test_describe_width_option():
    out = ok(invoke("describe", GRPO, "--width", "120"))
    assert max(len(line) for line in out.splitlines()) <= 120


def test_describe_config_lists_every_key_with_type_default_value_and_doc():
    out = ok(invoke("describe", PPO, "--config", "actor.lr=1e-6"))
    assert re.search(r"^ key\s+type\s+default\s+value\s+verl alias\s+doc$", out, re.M)
    # default 1e-06 from the stage, 0.0001 from the example's config, 1e-06 from the override
    assert re.search(r"^ actor\.lr\s+float\s+1e-06\s+1e-06 \(override\)\s+actor_rollout_ref\.actor\.optim\.lr\s+"
                     r"learning rate \(>= 0\)$", out, re.M)
    assert re.search(r"^ rollout\.backend\s+str\s+hf\s+hf\s+-\s+hf: transformers generate", out, re.M)
    assert re.search(r"^ groups\.critic\.dp\s+int\s+1\s+1\s+-\s+data-parallel size", out, re.M)
    pipeline, _ = load_pipeline(PPO)
    from rlgraph.graph.build import config_schema

    schema, _ = config_schema(pipeline)
    for key in schema:
        assert re.search(rf"^ {re.escape(key)}\s", out, re.M), key


def test_describe_config_still_lists_keys_when_other_checks_fail():
    out = ok(invoke("describe", PPO, "--config", "groups.actor.dp=100"))  # too many CPUs for the cluster
    assert re.search(r"^ groups\.actor\.dp\s+int\s+1\s+100 \(override\)", out, re.M)


def test_describe_config_reports_bad_keys():
    user_error(invoke("describe", PPO, "--config", "actor.lrr=1"), "did you mean 'actor.lr'")


# compile, validate, viz -------------------------------------------------------------------------


def test_compile_writes_plan_and_svg(tmp_path):
    out_dir = tmp_path / "build" / "ppo"
    out = ok(invoke("compile", PPO, "-o", str(out_dir), *ACCEPTANCE))
    pipeline, ref = load_pipeline(PPO)
    assert load_plan(out_dir / "plan.json") == compile_pipeline(pipeline, ACCEPTANCE, pipeline_ref=ref)
    assert "<svg" in (out_dir / "pipeline.svg").read_text()
    assert "compiled 'ppo': 8 ops in 4 stages, 4 worker groups" in out
    assert "padded batch 360 samples: 45 prompts x n=8 = 360, multiple 120, 0 pad rows" in out
    assert f"wrote {out_dir / 'plan.json'}" in out
    assert f"wrote {out_dir / 'pipeline.svg'}" in out


@pytest.mark.parametrize("example", ["grpo.py", "ppo.py", "dapo.py", "distill.py"])
def test_compiling_a_pipeline_imports_no_torch(example):
    """`rlgraph run` compiles before Ray starts: a torch import there (seconds) delays everything."""
    code = ("import sys; from rlgraph.graph.loader import load_pipeline; from rlgraph import compile; "
            f"compile(load_pipeline({str(ROOT / 'examples' / example)!r})[0], []); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'tensordict') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_viz_writes_a_drawing_from_a_pipeline_or_a_plan(tmp_path):
    svg = tmp_path / "ppo.svg"
    assert ok(invoke("viz", PPO, "-o", str(svg), "rollout.n=2")).strip() == f"wrote {svg}"
    assert "<svg" in svg.read_text()
    ok(invoke("compile", PPO, "-o", str(tmp_path / "c"), "rollout.n=2"))
    again = tmp_path / "again.svg"
    ok(invoke("viz", str(tmp_path / "c" / "plan.json"), "-o", str(again)))
    assert again.read_bytes() == svg.read_bytes()


def test_viz_unknown_extension_is_a_user_error(tmp_path):
    user_error(invoke("viz", PPO, "-o", str(tmp_path / "x.txt")), "name it .svg")


def test_validate_ok():
    out = ok(invoke("validate", PPO, *ACCEPTANCE))
    assert out.startswith("ok: 'ppo' passes every check (8 ops, 4 worker groups)")
    assert "padded batch 360 samples" in out


def test_validate_reports_every_problem_without_a_traceback():
    err = user_error(invoke("validate", PPO, "actor.lrr=1e-6", "rollout.n=x", "actor.mini_batch_size=100"),
                     "'ppo' has 3 problems", "[config-unknown-key]", "[config-type]", "[mini-batch-too-large]")
    assert "did you mean 'actor.lr'" in err
    assert "expected an int, got 'x'" in err


def test_validate_reports_resource_problems():
    user_error(invoke("validate", PPO, "groups.actor.dp=100"), "[resources]", "groups.actor.dp")


def test_malformed_override_is_bad_usage():
    result = invoke("validate", PPO, "actor.lr")
    assert result.exit_code == 2, result.output
    assert "'actor.lr' is not of the form key=value" in result.output
    assert "Traceback" not in result.output


# describe on a plan file -------------------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path) -> Path:
    ok(invoke("compile", PPO, "-o", str(tmp_path), *ACCEPTANCE, "actor.mini_batch_size=16"))
    return tmp_path / "plan.json"


def test_describe_a_plan_file(plan_file):
    out = ok(invoke("describe", str(plan_file)))
    assert padding(out) == (math.lcm(2, 2, 16 * 8, 15 * 8), 1920, 1920 - 360)
    assert "overrides: data.batch_size=45 rollout.n=8" in out
    assert out == ok(invoke("describe", PPO, *ACCEPTANCE, "actor.mini_batch_size=16"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON (line 1, column 2"),
        ('{"a": 1}', 'is not an rlgraph plan (no "format": "rlgraph.plan")'),
        ('{"format": "rlgraph.plan", "version": 2, "ops": []}', "is a malformed plan: rlgraph_version: Field required"),
    ],
)
def test_describe_a_broken_plan_file(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    user_error(invoke("describe", str(path)), message, "rlgraph compile")


def test_describe_a_plan_of_another_version(plan_file):
    raw = json.loads(plan_file.read_text())
    raw["version"] = 99
    plan_file.write_text(json.dumps(raw))
    user_error(invoke("describe", str(plan_file)), "is plan format version 99, but this rlgraph reads version 2",
               "recompile the pipeline")


def test_describe_a_missing_plan_file(tmp_path):
    user_error(invoke("describe", str(tmp_path / "nope.json")), "cannot read plan file")


# bad usage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "Usage: rlgraph"),
        (["describe"], "Missing argument 'PIPELINE|PLAN'"),
        (["compile", PPO], "Missing option '-o'"),
        (["viz", PPO], "Missing option '-o'"),
        (["describe", PPO, "--bogus"], "No such option '--bogus'"),
        (["describe", PPO, "--width", "10"], "Invalid value for '--width'"),
        (["train", PPO], "No such command 'train'"),
    ],
)
def test_bad_usage_exits_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_overrides_with_a_plan_are_bad_usage(plan_file):
    result = invoke("describe", str(plan_file), "rollout.n=2")
    assert result.exit_code == 2
    assert "cannot be applied to the compiled plan" in result.stderr
    result = invoke("viz", str(plan_file), "-o", str(plan_file.with_suffix(".svg")), "rollout.n=2")
    assert result.exit_code == 2


def test_config_listing_needs_a_pipeline(plan_file):
    result = invoke("describe", str(plan_file), "--config")
    assert result.exit_code == 2
    assert "--config needs a PIPELINE" in result.stderr


# loading PIPELINE --------------------------------------------------------------------------------


@pytest.fixture
def module_dir(tmp_path, monkeypatch) -> Path:
    """tmp_path on sys.path; modules imported from it are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("cli_test_"):
            del sys.modules[name]


def test_module_attr_reference(module_dir):
    (module_dir / "cli_test_pipes.py").write_text(
        (ROOT / "examples" / "ppo.py").read_text() + "\n\ndef make():\n    return pipeline\n\nnot_one = 3\n"
    )
    out = ok(invoke("describe", "cli_test_pipes:pipeline", *ACCEPTANCE))
    assert padding(out) == (120, 360, 0)
    assert "pipeline 'ppo' (cli_test_pipes:pipeline)" in out
    assert padding(ok(invoke("describe", "cli_test_pipes:make", *ACCEPTANCE))) == (120, 360, 0)
    user_error(invoke("describe", "cli_test_pipes:not_one"), "is a int, not an rlgraph Pipeline")
    user_error(invoke("describe", "cli_test_pipes:nothing"), "has no attribute 'nothing'")
    user_error(invoke("describe", "cli_test_absent:pipeline"), "cannot import module 'cli_test_absent'")


def test_module_that_raises_on_import(module_dir):
    (module_dir / "cli_test_broken.py").write_text("x = 1\ny = x / 0\n")
    err = user_error(invoke("validate", "cli_test_broken:pipeline"), "ZeroDivisionError: division by zero")
    assert "cli_test_broken.py:2" in err


def test_pipeline_file_that_raises_on_import(tmp_path):
    bad = tmp_path / "bad_pipeline.py"
    bad.write_text("import rlgraph\n\nraise RuntimeError('no GPU here')\n")
    user_error(invoke("describe", str(bad)), f"{bad}:3", "RuntimeError: no GPU here")


def test_pipeline_file_with_a_bad_declaration(tmp_path):
    bad = tmp_path / "bad_group.py"
    bad.write_text("from rlgraph import WorkerGroup\n\ng = WorkerGroup('not a name')\n")
    user_error(invoke("validate", str(bad)), "worker group name 'not a name' must be a Python identifier")


def test_bad_pipeline_references(tmp_path):
    user_error(invoke("describe", str(tmp_path / "missing.py")), "does not exist")
    user_error(invoke("describe", "no-colon-here"), "is neither a Python file nor a module:attr reference")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    user_error(invoke("describe", str(empty)), "defines no Pipeline")


# the installed console script --------------------------------------------------------------------


def test_console_script_smoke(tmp_path):
    """The `rlgraph` script runs a module:attr from the working directory, as users call it."""
    script = Path(sys.executable).with_name("rlgraph")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "rlgraph.cli"]
    (tmp_path / "smoke_pipes.py").write_text((ROOT / "examples" / "ppo.py").read_text())
    proc = subprocess.run([*command, "describe", "smoke_pipes:pipeline", *ACCEPTANCE], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert padding(proc.stdout) == (120, 360, 0)
    bad = subprocess.run([*command, "validate", "smoke_pipes:pipeline", "actor.lrr=1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "did you mean 'actor.lr'" in bad.stderr and "Traceback" not in bad.stderr


def test_heavy_padding_is_warned_about():
    # lcm(2, 16*8, 15*8) = lcm(2, 128, 120) = 1920 > 360 samples: 1560 padding rows (433%)
    result = invoke("validate", PPO, "data.batch_size=45", "rollout.n=8", "groups.actor.dp=2",
                    "actor.mini_batch_size=16", "critic.mini_batch_size=15")
    assert result.exit_code == 0, result.output
    assert "warning: padding adds 1560 rows to 360 samples (433%)" in result.output
    quiet = invoke("validate", PPO, "data.batch_size=45", "rollout.n=8", "actor.mini_batch_size=15",
                   "critic.mini_batch_size=15")  # lcm(120, 120) = 120 divides 360: no padding
    assert "warning" not in quiet.output


def test_validate_reads_the_data_before_anything_starts(tmp_path):
    """A missing prompt file, or rows without reward_model.ground_truth, fail `validate` (exit 1)."""
    grpo = str(Path(__file__).resolve().parents[1] / "examples" / "grpo.py")
    res = CliRunner().invoke(cli, ["validate", grpo, f"data.path={tmp_path / 'nope.parquet'}"])
    assert res.exit_code == 1 and "prompt file" in res.output and "does not exist" in res.output, res.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "data_source": "add", "reward_model": {}}) + "\n")
    res = CliRunner().invoke(cli, ["validate", grpo, f"data.path={rows}"])
    assert res.exit_code == 1 and "reward_model.ground_truth" in res.output, res.output
    res = CliRunner().invoke(cli, ["validate", grpo, f"actor.model_path={tmp_path / 'built_later'}"])
    assert res.exit_code == 0, res.output
    assert "note: the tokenizer of actor.model_path" in res.output and "does not exist yet" in res.output
