"""The GPU paths of the training worker: models on the worker's CUDA device, the reference in
bfloat16, outputs back in CPU memory, FSDP2 choosing bf16 mixed precision, generation on the GPU.
Skipped without a GPU (the CPU paths are every other test under tests/ops/train)."""

import math

import pytest
import torch

from rlgraph.ops.models import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = "cuda"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=3))


def test_the_policy_trains_on_the_gpu_and_hands_back_cpu_tensors(model_dir):
    from tests.ops.train.test_actor_options import batch, ctx_for, update, worker

    w = worker(model_dir, packing=True)
    assert next(w.model.parameters()).device.type == GPU
    cols = batch()
    metrics, ref = update(w, cols, model_dir, budget=16, packing=True)
    assert math.isfinite(metrics["loss"]) and metrics["micro_batches"] > 1
    # the reference (no LoRA: a model of its own) in bfloat16 where the GPU has it; its output in CPU memory
    assert next(w.ref_model.parameters()).device.type == GPU
    assert next(w.ref_model.parameters()).dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else
                                                     torch.float32)
    assert ref.device.type == "cpu" and ref.dtype == torch.float32
    assert all(v.device.type == "cpu" for v in w._weights(step=0)["state"].values())
    logp = w.compute_log_prob(**{k: v for k, v in cols.items() if k != "advantages"}, compare_rollout=False,
                              ctx=ctx_for(model_dir, "old_logprob"))["old_log_probs"]
    assert logp.device.type == "cpu"


def test_fsdp2_picks_bf16_mixed_precision_on_a_gpu():
    from rlgraph.ops.train.engine import EngineConfig, create_engine

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(GPU)
    engine = create_engine(model, EngineConfig(backend="fsdp2", lr=1e-3))
    assert engine.mixed_precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    batch = {"x": torch.randn(4, 8), "response_mask": torch.ones(4, 1)}

    def loss_fn(m, mb, global_tokens, global_seqs):
        return m(mb["x"]).float().pow(2).sum() / global_tokens, {}

    (record,) = engine.train(batch, loss_fn, mini_batch_size=4, micro_batch_size=2)
    assert record["grad_norm"] > 0
    assert all(v.device.type == GPU for v in engine.weights().values())


def test_fsdp2_cpu_offload_keeps_shards_in_cpu_memory():
    from rlgraph.ops.train.engine import EngineConfig, create_engine

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(GPU)
    engine = create_engine(model, EngineConfig(backend="fsdp2", lr=1e-3, cpu_offload=True))
    assert engine.offloaded
    assert all(p.to_local().device.type == "cpu" for p in engine.module.parameters())
    batch = {"x": torch.randn(4, 8), "response_mask": torch.ones(4, 1)}
    (record,) = engine.train(batch, lambda m, mb, global_tokens, global_seqs: (m(mb["x"]).float().sum() / 4, {}),
                             mini_batch_size=4, micro_batch_size=4)
    assert record["grad_norm"] > 0


def test_hf_generation_runs_on_the_gpu(model_dir):
    from rlgraph.ops.models import load_causal_lm, load_tokenizer
    from rlgraph.ops.rollout.parts import hf_parts

    model, tok = load_causal_lm(model_dir).to(GPU), load_tokenizer(model_dir, padding_side="left")
    prompts = [torch.tensor(tok.encode("12+3=")), torch.tensor(tok.encode("4+5="))]
    parts = list(hf_parts(model, tok, prompts, [False, False], n=2, seed=0, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=4, logprobs=True, micro_batch_size=0))
    assert parts
    for _, cols in parts:
        assert all(t.device.type == "cpu" for t in cols.values() if isinstance(t, torch.Tensor))
