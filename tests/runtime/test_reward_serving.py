"""Reward serving on real Ray and TransferQueue: a pool of reward workers, overlap with
generation, and the failure policies (fail, zero, drop_group) for raising and stalling functions."""

import json
from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.invoke import OpError
from rlgraph.runtime.runner import RunOptions, run_plan

pytestmark = pytest.mark.ray

RES = Path(__file__).parents[1] / "resources"
PIPELINE = str(RES / "reward_pipeline.py")
FNS = str(RES / "reward_fns.py")


def _plan(*overrides):
    pipeline, ref = load_pipeline(PIPELINE)
    return compile(pipeline, list(overrides), pipeline_ref=ref)


def _run(plan, out, plane, **kw):
    return run_plan(plan, RunOptions(out_dir=out, timeout_s=120, **kw), plane=plane)


def _odd_rows(plan, seed=0):
    """Ground truths of step 0's samples, as the source will produce them (same seed)."""
    from rlgraph.ops.data.prompts import PromptSource

    src = PromptSource(plan.config["data"], seed=seed, plan_config=plan.config)
    batch = src.next_batch(plan.batch.batch_size)
    return [int(gt) % 2 == 1 for gt in batch["ground_truth"]]


def test_pool_of_workers_shares_the_load_and_overlaps_generation(tq_plane, tmp_path):
    plan = _plan("generate.delay_s=0.3", "generate.micro_batch_size=1", "reward.micro_batch_size=4",
                 f"reward.fn={FNS}:slow")
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1, schedule="stream")
    rows = [rec[f"load/reward/rank_{r}/rows"] for r in range(3)]
    assert sum(rows) == plan.batch.padded_batch == 24
    assert all(r >= 4 for r in rows), rows  # every worker of the pool scored samples
    assert rec["score/mean"] == 1.0 and rec["reward/reward_metrics/scored_count"] == 24
    assert rec["samples/trained"] == 24 and rec["samples/dropped"] == 0
    # under stream, scoring starts while generation is still running (trace.json, Perfetto format)
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    gen_end = max(e["ts"] + e["dur"] for e in events if e["name"].startswith("generate"))
    first_reward = min(e["ts"] for e in events if e["name"].startswith("reward"))
    assert first_reward < gen_end


@pytest.mark.slow
def test_sync_schedule_waits_for_generation(tq_plane, tmp_path):
    plan = _plan("generate.delay_s=0.1", "generate.micro_batch_size=1", "reward.micro_batch_size=4")
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1, schedule="sync")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    gen_end = max(e["ts"] + e["dur"] for e in events if e["name"].startswith("generate"))
    assert min(e["ts"] for e in events if e["name"].startswith("reward")) >= gen_end
    assert rec["score/mean"] == 1.0


def test_wrong_answers_score_zero(tq_plane, tmp_path):
    plan = _plan("generate.wrong_every=2")
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    assert rec["score/mean"] == 0.5


@pytest.mark.slow
def test_raising_function_fails_the_step_by_default(tq_plane, tmp_path):
    plan = _plan(f"reward.fn={FNS}:raise_on_odd")
    with pytest.raises(OpError, match=r"(?s)reward function .*raise_on_odd.* failed on \d+ of \d+ samples.*"
                                      r"ValueError: odd ground truth.*reward.on_error=zero"):
        _run(plan, tmp_path, tq_plane, steps=1)


@pytest.mark.slow
def test_raising_function_scores_zero(tq_plane, tmp_path):
    plan = _plan(f"reward.fn={FNS}:raise_on_odd", "reward.on_error=zero")
    odd = _odd_rows(plan)
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    n_odd = 4 * sum(odd)
    assert 0 < n_odd < 24
    assert rec["reward/reward_metrics/error_count"] == n_odd
    assert rec["samples/dropped"] == 0 and rec["samples/trained"] == 24
    assert rec["score/mean"] == pytest.approx((24 - n_odd) / 24)


def test_raising_function_drops_the_groups(tq_plane, tmp_path):
    plan = _plan(f"reward.fn={FNS}:raise_on_odd", "reward.on_error=drop_group", "reward.micro_batch_size=3")
    odd = _odd_rows(plan)
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    n_odd = 4 * sum(odd)
    assert rec["samples/dropped"] == rec["samples/dropped/reward_error"] == n_odd
    # produced = trained + dropped (+ padding rows, none here)
    assert rec["samples/real"] == rec["samples/trained"] + rec["samples/dropped"] == 24
    assert rec["samples/padding"] == 0
    assert rec["score/mean"] == 1.0  # only the kept (even) groups, all answered correctly


@pytest.mark.parametrize("executor", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_stalling_function_times_out_and_drops_the_groups(tq_plane, tmp_path, executor):
    plan = _plan(f"reward.fn={FNS}:stall_on_odd", "reward.on_error=drop_group", "reward.timeout_s=0.5",
                 f"reward.executor={executor}", "reward.micro_batch_size=8", "reward.concurrency=4")
    odd = _odd_rows(plan)
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    n_odd = 4 * sum(odd)
    assert rec["reward/reward_metrics/timeout_count"] == n_odd
    assert rec["samples/dropped/reward_timeout"] == n_odd
    assert rec["samples/trained"] == 24 - n_odd
    # no call waited for its 30 s stalls (a process pool's first call also starts its processes)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert max(e["dur"] for e in events if e.get("ph") == "X" and e["name"].startswith("reward")) < 25e6


def test_async_function_times_out(tq_plane, tmp_path):
    plan = _plan(f"reward.fn={FNS}:async_stall_on_odd", "reward.on_error=zero", "reward.timeout_s=0.3")
    odd = _odd_rows(plan)
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    assert rec["reward/reward_metrics/timeout_count"] == 4 * sum(odd)
    assert rec["samples/dropped"] == 0


def test_bad_return_value_is_an_error_per_sample(tq_plane, tmp_path):
    plan = _plan(f"reward.fn={FNS}:not_a_number")
    with pytest.raises(OpError, match=r"returned str 'high'; return a float"):
        _run(plan, tmp_path, tq_plane, steps=1)
