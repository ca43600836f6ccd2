"""The agent op in a pipeline on Ray and TransferQueue: it compiles, `validate` resolves its
environment, two steps train, and the stream and sync schedules give the same records."""

import json
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
    # the timeline: each traced trajectory's turns and environment steps, in the trace and the chart
    trace = json.loads((tmp_path / "stream" / "trace.json").read_text())["traceEvents"]
    labels = {e["name"] for e in trace if e.get("ph") == "X" and "lane" in e.get("args", {})}
    assert {"turn 0", "turn 1", "env step"} <= labels
    assert "inside agent" in (tmp_path / "stream" / "timeline.svg").read_text()


def test_the_agent_rolls_out_a_step_ahead_with_max_staleness(model_dir, tq_plane, tmp_path):
    """trainer.max_staleness=1: the agent op runs ahead like generate, and every sample it made is
    at most one policy version old when trained on."""
    from rlgraph import WorkerGroup
    from rlgraph.ops import stages

    pipeline, ref = load_pipeline(str(RES / "agent_pipeline.py"))
    ahead = pipeline.with_ops(stages.agent_rollout(env="tests.resources.agent_envs:GuessNumber", group="rollout")) \
        .with_groups(WorkerGroup("rollout", dp=1, num_cpus=1))
    plan = rlgraph.compile(ahead, [f"actor.model_path={model_dir}", "trainer.max_staleness=1"], pipeline_ref=ref)
    records = run_plan(plan, RunOptions(out_dir=tmp_path / "k1", steps=3, timeout_s=300), plane=tq_plane)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert max(r["update_actor/actor_metrics/staleness_max"] for r in records) <= 1.0
    assert records[-1]["update_actor/actor_metrics/staleness_max"] == 1.0  # it did run ahead


def test_the_plan_picture_names_the_environment(model_dir, tmp_path):
    from rlgraph.graph.viz import dot_source

    src = dot_source(_plan(model_dir))
    assert "env: GuessNumber" in src and "at most 3 turns, 24 tokens" in src


@pytest.mark.vllm
@pytest.mark.slow
def test_turns_on_vllm_take_token_ids_and_the_run_trains(model_dir, tq_plane, tmp_path):
    """rollout.backend=vllm: each turn's histories go to the engine as token ids; the trajectories
    keep their masks and the schedules still agree."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    plan = _plan(model_dir, "rollout.backend=vllm")
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, schedule="stream", timeout_s=600),
                      plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=600),
                    plane=tq_plane)
    volatile = (*VOLATILE, "agent/rollout_metrics/engine_start_s", "agent/rollout_metrics/weight_sync")
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in stream] == \
        [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in sync]
    for rec in stream:
        assert math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert rec["agent/rollout_metrics/observation_tokens_mean"] > 0
        assert rec["agent/rollout_metrics/env_errors"] == 0.0
