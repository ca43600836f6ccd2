"""The bundled examples on real (tiny) models, Ray and TransferQueue: a few steps each.

Checks what must hold whatever the learning curve: finite losses, weights that changed, and
identical results under the stream and sync schedules.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlgraph
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.checkpoint import load_state
from rlgraph.runtime.export import WORKER_CLASSES
from rlgraph.runtime.runner import Fault, RunOptions, run_plan

pytestmark = pytest.mark.ray

ROOT = Path(__file__).parents[2]
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/")  # load: which rank ran a chunk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=100))


def _plan(example, model_dir, *extra):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / f"{example}.py"))
    small = [f"actor.model_path={model_dir}", "data.batch_size=4", "rollout.n=4", "actor.mini_batch_size=2",
             "trainer.save_every=2", "data.num_rows=64", *extra]
    if example == "ppo":
        small += ["critic.mini_batch_size=2"]
    return rlgraph.compile(pipeline, small, pipeline_ref=ref)


def _policy(ckpt: Path, worker: str = "actor_0") -> dict:
    """The policy's saved state (model, optimizer) on `worker`: its ActorWorker's, beside the states of the
    other worker classes its group runs (the advantage's KL controller in examples/grpo.py)."""
    return load_state(ckpt, worker)["instances"][WORKER_CLASSES["actor"]]


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.parametrize("example", ["grpo", "grpo_reward_pool", pytest.param("ppo", marks=pytest.mark.slow)])
def test_example_trains_and_schedules_agree(example, model_dir, tq_plane, tmp_path):
    plan = _plan(example, model_dir)
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, schedule="stream", timeout_s=300),
                      plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=300),
                    plane=tq_plane)
    assert _stable(stream) == _stable(sync)
    if example == "grpo":  # every op on the actor: the policy's worker killed inside generation's fused call
        assert plan.op("advantage").fused_into == "generate"  # (in the advantage) is restored and the step replayed
        killed = run_plan(plan, RunOptions(out_dir=tmp_path / "killed", steps=2, timeout_s=300,
                                           faults=[Fault("advantage", step=1, chunk=0, kind="kill")]), plane=tq_plane)
        assert killed[0]["faults/restarts"] == 0 and killed[1]["faults/restarts"] >= 1
        assert _stable(killed) == [{**r, "faults/retries": k["faults/retries"], "faults/restarts": k["faults/restarts"]}
                                   for r, k in zip(_stable(stream), killed)]
    if example == "grpo_reward_pool":  # the advantage rides in the reward's calls; its worker killed inside it
        assert plan.op("advantage").fused_into == "reward"  # keeps no state: one restart, the same run
        killed = run_plan(plan, RunOptions(out_dir=tmp_path / "killed", steps=2, timeout_s=300,
                                           faults=[Fault("advantage", step=1, chunk=0, kind="kill")]), plane=tq_plane)
        assert [r["faults/restarts"] for r in killed] == [0, 1]
        assert _stable(killed) == [{**r, "faults/retries": k["faults/retries"], "faults/restarts": k["faults/restarts"]}
                                   for r, k in zip(_stable(stream), killed)]
    for rec in stream:
        losses = {k: v for k, v in rec.items() if k.endswith("_metrics/loss")}
        assert losses, sorted(rec)
        assert all(math.isfinite(v) for v in losses.values()), losses
        assert 0.0 <= rec["score/mean"] <= 1.0
        assert rec["samples/real"] == 16 and rec["driver/payload_bytes"] == 0
        assert rec["update_actor/actor_metrics/optimizer_steps"] == 2  # 16 samples / (2 prompts x 4)
    if example == "ppo":
        assert math.isfinite(stream[-1]["update_critic/critic_metrics/vf_loss"])
    # the policy after two updates differs from the warm-started one it began with (the warm start
    # makes it right some of the time, so GRPO groups have non-zero advantages)
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    state = _policy(tmp_path / "stream" / "checkpoints" / "step_1")
    changed = [k for k, v in state["model"].items() if k in before and not torch.equal(v, before[k])]
    assert changed, "no weight changed"
    lines = (tmp_path / "stream" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 1]


def test_the_update_inside_generation_s_call_changes_no_result_and_a_failure_in_it_is_restored(model_dir, tq_plane,
                                                                                               tmp_path, monkeypatch):
    # one actor rank: the update closes generation's fused chain and a step is one call, queued on the
    # actor behind the step before's (but after a checkpoint, which drains the steps in flight). Every op
    # dispatched on its own (trainer.fuse_ops=false; generation queued behind the update) gives the same
    # records; an update that fails inside the call is not run again in place (it may have stepped) but
    # restored from the step-1 checkpoint, and steps 2 and 3 replayed to the same records (step 3's call,
    # queued behind the failed one, is not run: its worker checks)
    from rlgraph.runtime.fleet import Fleet

    sent = []
    submit = Fleet.submit

    def spy(self, call, step, *args, **kwargs):
        sent.append((step, call.chunk.op, call.after))
        return submit(self, call, step, *args, **kwargs)

    monkeypatch.setattr(Fleet, "submit", spy)
    plan = _plan("grpo", model_dir)
    assert plan.followers("generate")[-1] == "update_actor"
    fused = run_plan(plan, RunOptions(out_dir=tmp_path / "fused", steps=4, timeout_s=300), plane=tq_plane)
    assert [(step, "/".join(after.split("/")[-2:])) for step, _, after in sent] == [
        (0, ""), (1, "generate/0"), (2, ""), (3, "generate/0")]  # steps 1 and 3 behind 0 and 2; 2 after a checkpoint
    sent.clear()
    apart = run_plan(_plan("grpo", model_dir, "trainer.fuse_ops=false"),
                     RunOptions(out_dir=tmp_path / "apart", steps=4, timeout_s=300), plane=tq_plane)
    assert _stable(fused) == _stable(apart)
    assert [(step, op) for step, op, after in sent if after] == [(1, "generate"), (3, "generate")]
    from rlgraph.runtime.reporter import Reporter

    class Faults(Reporter):
        seen: list[str] = []

        def fault(self, message: str) -> None:
            self.seen.append(message)

    failed = run_plan(plan, RunOptions(out_dir=tmp_path / "failed", steps=4, timeout_s=300, reporter=Faults(),
                                       faults=[Fault("update_actor", step=2, chunk=0, kind="raise")]), plane=tq_plane)
    assert [r["faults/retries"] for r in failed] == [0, 0, 1, 0]
    assert len(Faults.seen) == 1 and "op 'generate' failed" in Faults.seen[0] and "restoring every worker" in Faults.seen[0]
    assert _stable(failed) == [{**r, "faults/retries": f["faults/retries"], "faults/restarts": f["faults/restarts"]}
                               for r, f in zip(_stable(fused), failed)]


def test_the_update_s_own_forward_gives_what_the_old_logprob_pass_gave(model_dir, tq_plane, tmp_path):
    # one mini-batch of one epoch per step: the compiler leaves old_logprob out and the update takes
    # old log-probs from its first forward; the same run with trainer.reuse_forward=false runs the
    # pass. Losses, KL and the trained weights agree to float tolerance (verl's result either way)
    reused = _plan("grpo", model_dir, "actor.mini_batch_size=4", "trainer.save_every=1")
    kept = _plan("grpo", model_dir, "actor.mini_batch_size=4", "trainer.save_every=1", "trainer.reuse_forward=false")
    assert "old_logprob" in reused.reused and "old_logprob" not in [o.name for o in reused.ops]
    assert not kept.reused and "old_logprob" in [o.name for o in kept.ops]
    a = run_plan(reused, RunOptions(out_dir=tmp_path / "reused", steps=2, timeout_s=300), plane=tq_plane)
    b = run_plan(kept, RunOptions(out_dir=tmp_path / "kept", steps=2, timeout_s=300), plane=tq_plane)
    for ra, rb in zip(a, b):
        assert ra["score/mean"] == rb["score/mean"]  # the same samples: step 0's update changed the same weights
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
            name = f"update_actor/actor_metrics/{key}"
            assert ra[name] == pytest.approx(rb[name], rel=1e-4, abs=1e-6), name
        assert ra["update_actor/actor_metrics/pg_clipfrac"] == 0.0  # the ratio is exactly 1
    wa = _policy(tmp_path / "reused" / "checkpoints" / "step_1")
    wb = _policy(tmp_path / "kept" / "checkpoints" / "step_1")
    for k, v in wa["model"].items():
        torch.testing.assert_close(v, wb["model"][k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_data_parallel_actor_keeps_replicas_identical(model_dir, tq_plane, tmp_path):
    # actor dp=2: two Ray actors in one process group (DDP over gloo); after the update both
    # ranks must hold the same weights, and they must differ from the warm start
    plan = _plan("grpo", model_dir, "groups.actor.dp=2", "trainer.save_every=1")
    (rec,) = run_plan(plan, RunOptions(out_dir=tmp_path, steps=1, timeout_s=300), plane=tq_plane)
    assert math.isfinite(rec["update_actor/actor_metrics/loss"])
    ckpt = tmp_path / "checkpoints" / "step_0"
    rank0, rank1 = _policy(ckpt, "actor_0"), _policy(ckpt, "actor_1")
    assert all(torch.equal(v, rank1["model"][k]) for k, v in rank0["model"].items())
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    assert any(not torch.equal(v, before[k]) for k, v in rank0["model"].items() if k in before)


@pytest.mark.slow
def test_gspo_loss_mode_trains_the_grpo_example(model_dir, tq_plane, tmp_path):
    """actor.loss_mode=gspo through the whole stack: a finite loss, sequence-level clipping at the
    paper's tiny clip ranges (with two epochs the second sees ratios away from 1), weights changed."""
    plan = _plan("grpo", model_dir, "actor.loss_mode=gspo", "actor.clip_ratio_low=0.0003",
                 "actor.clip_ratio_high=0.0004", "actor.ppo_epochs=2", "trainer.save_every=1")
    (rec,) = run_plan(plan, RunOptions(out_dir=tmp_path, steps=1, timeout_s=300), plane=tq_plane)
    assert math.isfinite(rec["update_actor/actor_metrics/loss"])
    assert rec["update_actor/actor_metrics/pg_clipfrac"] > 0  # the second epoch's sequence ratios clip
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    state = _policy(tmp_path / "checkpoints" / "step_0")
    assert any(not torch.equal(v, before[k]) for k, v in state["model"].items() if k in before)


def _dapo(model_dir, *extra):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "dapo.py"))
    # responses of at most 4 tokens (rollout.max_new_tokens), a buffer of 3: 2 tokens -> -1/3 ...
    return rlgraph.compile(pipeline, [f"actor.model_path={model_dir}", "data.batch_size=8", "rollout.n=4",
                                      "actor.mini_batch_size=2", "data.num_rows=64", "overlong.buffer_len=3",
                                      "overlong.penalty_factor=1.0", *extra], pipeline_ref=ref)


def test_dapo_refills_its_batch_with_kept_groups_and_schedules_agree(model_dir, tq_plane, tmp_path):
    """examples/dapo.py: the rule reward, the overlong penalty (shaped_scores) and dynamic
    sampling's filter on the rule score, then rounds of fresh prompts until 8 groups are kept. The
    batch holds exactly the first 8 kept groups (no padding: 32 rows is the multiple); every
    sample of every round is accounted for; stream and sync give identical steps."""
    plan = _dapo(model_dir)
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, timeout_s=300), plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=300),
                    plane=tq_plane)
    assert _stable(stream) == _stable(sync)
    refilled = False
    for rec in stream:
        assert rec["overlong/overlong_metrics/penalty_mean"] < 0  # some responses ran into the buffer
        rounds = rec["refill/rounds"]
        assert 1 <= rounds <= 3 and rec["refill/exhausted"] == 0 and rec["refill/kept_groups"] == 8
        groups = rec["filter_groups/filter_groups_metrics/groups_count"]
        dropped = rec["filter_groups/filter_groups_metrics/dropped_groups_count"]
        assert groups == 8 * rounds == rec["refill/generated_groups"]
        assert rec["filter_groups/filter_groups_metrics/kept_groups_count"] == groups - dropped
        assert rec["samples/real"] == 32 * rounds and rec["samples/trained"] == 32 and rec["samples/padding"] == 0
        assert rec.get("samples/dropped/zero_variance", 0) == 4 * dropped
        assert rec.get("samples/dropped/surplus", 0) == 4 * (groups - dropped - 8)
        assert rec["samples/real"] == rec["samples/trained"] + rec["samples/dropped"]
        assert rec["update_actor/actor_metrics/optimizer_steps"] == 4  # 32 samples / (2 prompts x 4)
        assert math.isfinite(rec["update_actor/actor_metrics/loss"]) and rec["driver/payload_bytes"] == 0
        assert 0 <= rec["generated/acc/mean"] <= 1 and 0 < rec["acc/mean"] < 1  # trained groups are mixed
        refilled |= rounds > 1
    assert refilled  # the warm-started model answers some prompts always (or never) right: a round is not enough


@pytest.mark.slow
def test_dapo_when_the_rounds_run_out(model_dir, tq_plane, tmp_path):
    """No group can be kept (min_std above any std of 0/1 scores): with on_exhaust=train the step
    trains on nothing (a batch of padding, the update's loss finite), with fail it stops with
    RefillExhausted naming the step, the counts and the fixes."""
    from rlgraph.errors import RefillExhausted

    never = ["filter_groups.min_std=10", "filter_groups.max_rounds=2"]
    plan = _dapo(model_dir, *never)
    with pytest.warns(UserWarning, match="dynamic sampling kept 0 of the 8 groups"):
        (rec,) = run_plan(plan, RunOptions(out_dir=tmp_path / "train", steps=1, timeout_s=300), plane=tq_plane)
    assert rec["refill/exhausted"] == 1 and rec["refill/rounds"] == 2 and rec["refill/kept_groups"] == 0
    assert rec["samples/real"] == 64 and rec["samples/dropped/zero_variance"] == 64 and rec["samples/trained"] == 0
    assert rec["samples/padding"] == plan.batch.multiple == 8  # every op ran on padding rows only
    assert math.isfinite(rec["update_actor/actor_metrics/loss"])
    with pytest.raises(RefillExhausted, match=r"step 0: dynamic sampling kept 0 of the 8 groups a batch needs after "
                       r"2 round\(s\).*raise filter_groups.max_rounds"):
        run_plan(_dapo(model_dir, *never, "filter_groups.on_exhaust=fail"),
                 RunOptions(out_dir=tmp_path / "fail", steps=1, timeout_s=300), plane=tq_plane)
