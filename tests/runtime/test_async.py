"""Asynchronous training on real Ray and TransferQueue (examples/grpo_async.py, a tiny model): the
rollout runs a step ahead of the update, no sample older than trainer.max_staleness is trained on,
and a resume or a dead rollout worker ends exactly as an uninterrupted run with the same k."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.runner import Fault, RunOptions, run_plan

ROOT = Path(__file__).parents[2]
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/", "faults/")
STALE = "update_actor/actor_metrics/staleness_"


def test_the_update_refuses_samples_older_than_max_staleness():
    from rlgraph.ops.train.actor import ActorWorker, StalenessError

    worker = ActorWorker.__new__(ActorWorker)  # the guard alone: no model needed
    worker.policy_version, worker.max_staleness = 5, 1
    ctx = SimpleNamespace(is_padding=[False, False, True], step=7)
    got = worker._staleness(torch.tensor([4, 5, 0]), None, ctx)  # the padding row's version is not looked at
    assert got == {"staleness_mean": 0.5, "staleness_max": 1.0}
    with pytest.raises(StalenessError, match=r"versions \[3, 5\].*version 5; trainer.max_staleness=1 allows 4..5"):
        worker._staleness(torch.tensor([3, 5, 5]), None, ctx)
    # partial rollout: the first sample finished on the current weights
    got = worker._staleness(torch.tensor([4, 5, 0]), torch.tensor([5, 5, 0]), ctx)
    assert got == {"staleness_mean": 0.5, "staleness_max": 1.0, "staleness_end_mean": 0.0}
    with pytest.raises(StalenessError, match=r"policy_version_end is below its policy_version"):
        worker._staleness(torch.tensor([4, 5, 0]), torch.tensor([3, 5, 0]), ctx)
    with pytest.raises(StalenessError, match=r"or above this policy's version 5"):
        worker._staleness(torch.tensor([4, 5, 0]), torch.tensor([6, 5, 0]), ctx)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=20))


def _plan(model_dir, *overrides):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo_async.py"))
    small = [f"actor.model_path={model_dir}", "data.batch_size=4", "rollout.n=4", "actor.mini_batch_size=4",
             "data.num_rows=64", "trainer.save_every=2"]
    return compile(pipeline, [*small, *overrides], pipeline_ref=ref)


def _run(plan, out, plane, **kw):
    return run_plan(plan, RunOptions(out_dir=out, timeout_s=180, **kw), plane=plane)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.fixture(scope="module")
def baseline(model_dir, tq_plane, tmp_path_factory):
    out = tmp_path_factory.mktemp("k1")
    return _run(_plan(model_dir), out, tq_plane, steps=4), out


@pytest.mark.ray
def test_rollout_runs_a_step_ahead_with_staleness_one(baseline):
    records, out = baseline
    assert [r[STALE + "max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert [r[STALE + "mean"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    start = {(s["name"], s["args"]["step"]): s["ts"] for s in spans}
    end = {(s["name"], s["args"]["step"]): s["ts"] + s["dur"] for s in spans}
    # step t+1's generation starts before step t's update ends, for the steps that are no checkpoint
    # steps (save_every=2 drains the window after steps 1 and 3)
    assert start[("generate", 1)] < end[("update_actor", 0)] and start[("generate", 3)] < end[("update_actor", 2)]
    assert start[("generate", 2)] > end[("update_actor", 1)]
    assert all("timing/idle/rollout_s" in r for r in records[1:])


@pytest.mark.ray
@pytest.mark.slow
def test_resume_and_a_dead_rollout_worker_end_as_the_uninterrupted_run(model_dir, tq_plane, tmp_path, baseline):
    records, _ = baseline
    plan = _plan(model_dir)
    _run(plan, tmp_path / "resumed", tq_plane, steps=2)
    resumed = _run(plan, tmp_path / "resumed", tq_plane, steps=4, resume=True)
    assert _stable(resumed) == _stable(records[2:])
    # the rollout worker dies generating step 3 (steps 2 and 3 in flight): every worker is restored
    # from the step-1 checkpoint, with the weights the rollout of steps 2 and 3 must use, and replayed
    faulty = _run(plan, tmp_path / "faulty", tq_plane, steps=4, faults=[Fault("generate", step=3, kind="kill")])
    assert _stable(faulty) == _stable(records)
    assert faulty[3]["faults/retries"] == 1


@pytest.mark.ray
@pytest.mark.slow
def test_resume_before_the_first_update_sends_the_rollout_back_to_the_initial_weights(model_dir, tq_plane, tmp_path,
                                                                                       baseline):
    # checkpoint after step 0: step 1's rollout reads the initial weights (step 1 - 1 - 1 < 0), which the
    # restored rollout group no longer holds, so it is restarted; checkpoints every step do not change
    # the results either (the versions come from the plan)
    records, _ = baseline
    plan = _plan(model_dir, "trainer.save_every=1")
    _run(plan, tmp_path, tq_plane, steps=1)
    resumed = _run(plan, tmp_path, tq_plane, steps=4, resume=True)
    assert _stable(resumed) == _stable(records[1:])
    assert resumed[0]["faults/restarts"] == 1


@pytest.mark.ray
@pytest.mark.slow
def test_the_update_s_proximal_log_probs_are_the_separate_pass_s(model_dir, tq_plane, tmp_path, baseline):
    # decoupled PPO with one optimizer step per step: the compiler leaves old_logprob out and the update takes
    # the proximal log-probs from its own forward. With the pass kept (trainer.reuse_forward=false) the same
    # samples get the same behaviour weights, drops and losses, one update old from step 1 on
    records, _ = baseline
    kept_plan = _plan(model_dir, "trainer.reuse_forward=false")
    assert "old_logprob" in _plan(model_dir).reused and "old_logprob" in [o.name for o in kept_plan.ops]
    kept = _run(kept_plan, tmp_path, tq_plane, steps=4)
    for a, b in zip(records, kept):
        assert a["score/mean"] == b["score/mean"]
        for key in ("loss", "pg_loss", "grad_norm", "behaviour_weight_mean", "behaviour_dropped_frac"):
            name = f"update_actor/actor_metrics/{key}"
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    assert any(r["update_actor/actor_metrics/behaviour_weight_mean"] != 1.0 for r in records[1:])  # off-policy


@pytest.mark.ray
def test_max_staleness_zero_is_on_policy_and_schedules_agree(model_dir, tq_plane, tmp_path):
    plan = _plan(model_dir, "trainer.max_staleness=0")
    stream = _run(plan, tmp_path / "stream", tq_plane, steps=3)
    sync = _run(plan, tmp_path / "sync", tq_plane, steps=3, schedule="sync")
    assert _stable(stream) == _stable(sync)
    assert [r[STALE + "max"] for r in stream] == [0.0, 0.0, 0.0]


@pytest.mark.ray
def test_partial_rollout_weights_reach_a_running_call(tq_plane, tmp_path):
    """The runtime pushes each new weight version to the rollout while its call runs (the workers'
    control thread): the call of step t, started on the weights of step t-2, waits for and gets those
    of step t-1, never a later one. With the push off (partial=false) it keeps its start version."""
    pipeline, ref = load_pipeline(str(ROOT / "tests" / "resources" / "partial_pipeline.py"))
    on = run_plan(compile(pipeline, [], pipeline_ref=ref), RunOptions(out_dir=tmp_path / "on", timeout_s=120),
                  plane=tq_plane)
    got = [(r["update/update_metrics/v_start"], r["update/update_metrics/v_end"],
            r["update/update_metrics/v_end_min"]) for r in on]
    assert got == [(-1.0, -1.0, -1.0), (-1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (1.0, 2.0, 2.0)]
    off = run_plan(compile(pipeline, ["gen.partial=false", "gen.wait_s=0"], pipeline_ref=ref),
                   RunOptions(out_dir=tmp_path / "off", timeout_s=120), plane=tq_plane)
    assert [r["update/update_metrics/v_end"] for r in off] == [-1.0, -1.0, 0.0, 1.0]
