"""The training-engine options through the whole GRPO pipeline on Ray and TransferQueue.

Each option (padding-free packing with token-budget micro-batches, LoRA, FSDP2 with dp=2) must
keep what the plain run guarantees: stream == sync, an exact resume, and, where an option only
changes how the same numbers are computed, the plain run's losses."""

import math
from pathlib import Path

import pytest
import torch

import rlgraph
from rlgraph.graph.loader import load_pipeline
from rlgraph.ops.models import load_causal_lm
from rlgraph.runtime.checkpoint import load_state
from rlgraph.runtime.export import WORKER_CLASSES, ExportError, export_model
from rlgraph.runtime.runner import RunOptions, run_plan

pytestmark = pytest.mark.ray
pytest.importorskip("peft")

ROOT = Path(__file__).parents[3]
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/")
OPTIONS = {
    "packed": ["actor.packing=true", "actor.max_tokens_per_micro_batch=40", "old_logprob.max_tokens_per_micro_batch=60",
               "ref.max_tokens_per_micro_batch=60", "actor.logprob_chunk_size=3"],
    "lora": ["actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-3"],
    "fsdp2": ["groups.actor.dp=2", "actor.backend=fsdp2"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=100))


def _policy(ckpt, worker: str) -> dict:
    """The policy's saved state on `worker`: its ActorWorker's (examples/grpo.py's actor also runs the
    reward and the advantage, whose KL controller saves a state of its own)."""
    return load_state(ckpt, worker)["instances"][WORKER_CLASSES["actor"]]


def _plan(model_dir, *extra):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo.py"))
    small = [f"actor.model_path={model_dir}", "data.batch_size=4", "rollout.n=4", "actor.mini_batch_size=2",
             "actor.use_kl_loss=true", "trainer.save_every=1", "data.num_rows=64", *extra]
    return rlgraph.compile(pipeline, small, pipeline_ref=ref)


def _run(plan, out, plane, **kw):
    return run_plan(plan, RunOptions(out_dir=out, timeout_s=300, **kw), plane=plane)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_trains_and_stream_equals_sync(option, model_dir, tq_plane, tmp_path):
    plan = _plan(model_dir, *OPTIONS[option])
    stream = _run(plan, tmp_path / "stream", tq_plane, steps=2, schedule="stream")
    sync = _run(plan, tmp_path / "sync", tq_plane, steps=2, schedule="sync")
    assert _stable(stream) == _stable(sync)
    for rec in stream:
        assert math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert rec["update_actor/actor_metrics/kl_loss"] >= 0
    if option == "packed":  # no padding token computed, and micro-batches by the token budget
        rec = stream[0]
        assert rec["update_actor/actor_metrics/forward_tokens"] < rec["update_actor/actor_metrics/padded_tokens"]
        assert rec["update_actor/actor_metrics/micro_batches"] >= 2
    actor = _policy(tmp_path / "stream" / "checkpoints" / "step_1", "actor_0")
    if option == "lora":  # the checkpoint holds the adapters, not the 27 base tensors
        assert actor["model"] and all(".lora_" in k for k in actor["model"])
        _check_lora_export(tmp_path / "stream", model_dir, tmp_path)
    if option == "fsdp2":  # each rank's checkpoint holds its own shards
        other = _policy(tmp_path / "stream" / "checkpoints" / "step_1", "actor_1")
        shard0, shard1 = actor["trainer"]["model"], other["trainer"]["model"]
        assert set(shard0) == set(shard1) and any(not torch.equal(shard0[k], shard1[k]) for k in shard0)
        assert all(torch.equal(v, other["model"][k]) for k, v in actor["model"].items())  # the serving copies agree
        done = export_model(tmp_path / "stream", tmp_path / "hf")  # the whole weights, not rank 0's shards
        exported = load_causal_lm(done.out_dir).state_dict()
        assert all(torch.equal(exported[k], v) for k, v in actor["model"].items())
        with pytest.raises(ExportError, match="--merge merges LoRA adapters, but the actor .* trained all its weights"):
            export_model(tmp_path / "stream", tmp_path / "merged", merge=True)


@pytest.mark.slow  # the default run keeps the same check at the op level: tests/ops/train/test_actor_options.py
@pytest.mark.parametrize("option,baseline", [("packed", []), ("fsdp2", ["groups.actor.dp=2"])])
def test_option_gives_the_plain_run_s_losses(option, baseline, model_dir, tq_plane, tmp_path):
    """The first step sees the same samples, so its losses must agree to float tolerance."""
    a = _run(_plan(model_dir, *OPTIONS[option]), tmp_path / "option", tq_plane, steps=1)
    b = _run(_plan(model_dir, *baseline), tmp_path / "plain", tq_plane, steps=1)
    assert a[0]["score/mean"] == b[0]["score/mean"]
    for key in ("loss", "grad_norm"):
        name = f"update_actor/actor_metrics/{key}"
        assert a[0][name] == pytest.approx(b[0][name], rel=1e-4, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_resumes_exactly(option, model_dir, tq_plane, tmp_path):
    plan = _plan(model_dir, *OPTIONS[option])
    full = _run(plan, tmp_path / "full", tq_plane, steps=4)
    _run(plan, tmp_path / "cut", tq_plane, steps=2)
    resumed = _run(plan, tmp_path / "cut", tq_plane, steps=4, resume=True)
    assert [r["step"] for r in resumed] == [2, 3]
    assert _stable(resumed) == _stable(full[2:])


def _check_lora_export(run_dir, model_dir, tmp_path):
    """The adapter (peft's layout) on the base equals the merged export, and both differ from the base."""
    from peft import PeftModel

    adapter = export_model(run_dir, tmp_path / "adapter")
    assert adapter.kind == "adapter"
    assert {p.name for p in adapter.out_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    merged = export_model(run_dir, tmp_path / "merged", merge=True)
    assert merged.kind == "merged" and (merged.out_dir / "model.safetensors").is_file()
    x = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        via_peft = PeftModel.from_pretrained(load_causal_lm(model_dir), str(adapter.out_dir)).eval()(input_ids=x).logits
        via_merge = load_causal_lm(merged.out_dir)(input_ids=x).logits
        base = load_causal_lm(model_dir)(input_ids=x).logits
    torch.testing.assert_close(via_merge, via_peft, atol=1e-5, rtol=1e-4)
    assert (via_merge - base).abs().max() > 1e-4


@pytest.mark.slow
def test_ppo_with_an_fsdp2_critic_and_token_budgets(model_dir, tq_plane, tmp_path):
    """The critic takes the same engine options (backend, token budgets for its update and the values pass)."""
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "ppo.py"))
    plan = rlgraph.compile(pipeline, [f"actor.model_path={model_dir}", "data.batch_size=4", "rollout.n=4",
                                      "actor.mini_batch_size=2", "critic.mini_batch_size=2", "data.num_rows=64",
                                      "critic.backend=fsdp2", "critic.max_tokens_per_micro_batch=48",
                                      "values.max_tokens_per_micro_batch=48", "actor.backend=fsdp2"],
                           pipeline_ref=ref)
    stream = _run(plan, tmp_path / "stream", tq_plane, steps=2, schedule="stream")
    sync = _run(plan, tmp_path / "sync", tq_plane, steps=2, schedule="sync")
    assert _stable(stream) == _stable(sync)
    for rec in stream:
        assert math.isfinite(rec["update_critic/critic_metrics/loss"])
        assert rec["update_critic/critic_metrics/micro_batches"] >= 2


@pytest.mark.vllm
def test_fsdp2_lora_policy_reaches_a_vllm_engine(model_dir, tq_plane, tmp_path):
    """The vLLM rollout engine is given the FSDP2 worker's whole copy with the LoRA adapters merged, after every
    update: the generating policy is the trained one."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    plan = _plan(model_dir, "rollout.backend=vllm", "actor.backend=fsdp2", "actor.lora_rank=4", "actor.lora_alpha=8",
                 "actor.lr=1e-3")
    recs = _run(plan, tmp_path / "run", tq_plane, steps=2)
    assert recs[0]["generate/rollout_metrics/weight_sync_bytes"] == 0  # step 0: the engine's own weights
    assert recs[1]["generate/rollout_metrics/weight_sync_bytes"] > 100_000  # the merged policy after step 0
    assert all(math.isfinite(r["update_actor/actor_metrics/loss"]) for r in recs)
