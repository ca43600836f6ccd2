"""The agent op in a pipeline on Ray and TransferQueue: it compiles, `validate` resolves its
environment, two steps train, and the stream and sync schedules give the same records."""

import math
from pathlib import Path

import pytest

import rlgraph
from rlgraph.errors import RLGraphError
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.runner import RunOptions, run_plan

pytestmark = pytest.mark.ray

RES = Path(__file__).parents[2] / "resources"
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/", "agent/rollout_s", "agent/tool_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=100))


def _plan(model_dir, *extra):
    pipeline, ref = load_pipeline(str(RES / "agent_pipeline.py"))
    return rlgraph.compile(pipeline, [f"actor.model_path={model_dir}", *extra], pipeline_ref=ref)


def test_a_bad_environment_reference_fails_at_compile_time(model_dir):
    with pytest.raises(RLGraphError, match="rollout.env 'tests.resources.agent_envs:Nope'"):
        _plan(model_dir, "rollout.env=tests.resources.agent_envs:Nope")


def test_multi_turn_grpo_trains_and_schedules_agree(model_dir, tq_plane, tmp_path):
    plan = _plan(model_dir)
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, schedule="stream", timeout_s=300),
                      plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=300),
                    plane=tq_plane)
    stable = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in stream]
    assert stable == [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in sync]
    for rec in stream:
        assert math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert 1.0 <= rec["agent/rollout_metrics/turns_mean"] <= 3.0
        assert rec["agent/rollout_metrics/env_errors"] == 0.0
        # feedback turns put observation tokens (mask 0) into the responses
        assert rec["agent/rollout_metrics/observation_tokens_mean"] > 0
        assert 0.0 <= rec["score/mean"] <= 1.0
        assert rec["samples/real"] == 16 and rec["driver/payload_bytes"] == 0
