"""The compiled plan: frozen, JSON round-trip, deterministic, and validated when loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from rlgraph import PlanError, load_plan
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.plan import PLAN_FORMAT, PLAN_VERSION, Plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan(ppo) -> Plan:
    return compile_pipeline(ppo, ["data.batch_size=45", "rollout.n=8"], pipeline_ref="examples/ppo.py")


def test_save_then_load_gives_an_equal_plan(plan, tmp_path) -> None:
    path = plan.save(tmp_path / "out" / "plan.json")
    assert path.is_file()
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()
    assert loaded.op("update_actor").batching == plan.op("update_actor").batching


def test_json_is_plain_data_with_format_and_version(plan) -> None:
    raw = json.loads(plan.to_json())
    assert raw["format"] == PLAN_FORMAT == "rlgraph.plan"
    assert raw["version"] == PLAN_VERSION
    assert raw["pipeline"] == "ppo" and raw["pipeline_ref"] == "examples/ppo.py"
    assert raw["overrides"] == {"data.batch_size": "45", "rollout.n": "8"}
    assert raw["config"]["data"]["batch_size"] == 45  # nested, resolved
    assert raw["batch"]["global_batch"] == 45 * 8


def test_compiling_twice_gives_identical_json(ppo, grpo) -> None:
    for p in (ppo, grpo):
        first = compile_pipeline(p, ["groups.actor.dp=2"]).to_json()
        assert compile_pipeline(p, ["groups.actor.dp=2"]).to_json() == first


_COMPILE = (
    "import sys; from rlgraph.graph.loader import load_pipeline; import rlgraph; "
    "p, ref = load_pipeline('examples/ppo.py'); sys.stdout.write(rlgraph.compile(p, ['rollout.n=3']).to_json())"
)


def test_json_does_not_depend_on_the_hash_seed() -> None:
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1]


def test_plan_is_frozen(plan) -> None:
    with pytest.raises(pydantic.ValidationError):
        plan.pipeline = "other"  # type: ignore[misc]


def test_lookup_of_a_missing_op_or_group(plan) -> None:
    with pytest.raises(KeyError, match="plan has no op 'nope'"):
        plan.op("nope")
    with pytest.raises(KeyError, match="plan has no worker group 'nope'"):
        plan.group("nope")


# Loading errors -------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def test_missing_file(tmp_path) -> None:
    with pytest.raises(PlanError, match=r"cannot read plan file '.*nothing\.json'"):
        load_plan(tmp_path / "nothing.json")


def test_malformed_json(tmp_path) -> None:
    path = _write(tmp_path, '{"format": "rlgraph.plan",\n  "version": 1,,}')
    with pytest.raises(PlanError, match=r"plan\.json' is not valid JSON \(line 2, column \d+: .*\); recompile it"):
        load_plan(path)


@pytest.mark.parametrize("text", ['{"format": "something.else", "version": 1}', "[1, 2, 3]", '{"version": 1}'])
def test_not_a_plan(tmp_path, text) -> None:
    with pytest.raises(PlanError, match=r"is not an rlgraph plan \(no \"format\": \"rlgraph\.plan\"\); pass a "
                                        r"plan\.json written by `rlgraph compile`"):
        load_plan(_write(tmp_path, text))


def test_other_format_version(plan, tmp_path) -> None:
    raw = json.loads(plan.to_json())
    raw["version"] = 99
    with pytest.raises(PlanError, match=r"is plan format version 99, but this rlgraph reads version 2; "
                                        r"recompile the pipeline"):
        load_plan(_write(tmp_path, json.dumps(raw)))


def test_schema_violation_names_the_field(plan, tmp_path) -> None:
    raw = json.loads(plan.to_json())
    raw["batch"]["padded_batch"] = "lots"
    del raw["schedule"]
    with pytest.raises(PlanError, match=r"is a malformed plan: .*batch\.padded_batch: .*integer.*schedule: Field "
                                        r"required.*; recompile it") as info:
        load_plan(_write(tmp_path, json.dumps(raw)))
    assert info.value.__cause__ is None  # no pydantic traceback for the user


def test_unknown_field_is_refused(plan, tmp_path) -> None:
    raw = json.loads(plan.to_json())
    raw["ops"][0]["colour"] = "red"
    with pytest.raises(PlanError, match=r"ops\.0\.colour: Extra inputs are not permitted"):
        load_plan(_write(tmp_path, json.dumps(raw)))
