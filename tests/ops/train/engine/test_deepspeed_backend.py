"""The training engine, DeepSpeed backend on CPU (gloo): ZeRO 0-3 must train exactly like the torch
engine, take one optimizer step per mini-batch, round-trip its state, and gather ZeRO-3 weights.

One-rank engines run in this process (the engine makes a one-rank gloo group; the fixture
removes it afterwards); dp=2 runs in two rank processes started by test_engine.py's runner.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
# DeepSpeed 0.19.8 on torch 2.13: deprecations inside DeepSpeed, nothing we can act on
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
              pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_scatter_tensor` is deprecated"),
              pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")]

from rlgraph.ops.train.engine import EngineConfig, EngineError, TrainEngine, create_engine  # noqa: E402


def _load_helpers():
    # the torch-backend tests hold the model, losses and multi-rank runner; load them by path
    # (importlib import mode: test files are not an importable package)
    spec = importlib.util.spec_from_file_location("rlgraph_test_engine", Path(__file__).with_name("test_engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


h = _load_helpers()
CFG = {"lr": 1e-2, "lr_warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.01}
# tiny parameters would stay whole ("persistent") under ZeRO-3; partition every one of them
Z3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def ds_config(stage: int) -> dict:
    return {**CFG, "backend": "deepspeed", "zero_stage": stage, "deepspeed_config": Z3 if stage == 3 else {}}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """Leave no process group or rank variables behind for other test modules."""
    import torch.distributed as dist

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def train_twice(engine: TrainEngine, batch: dict) -> list[dict]:
    # 16 rows, mini-batch 8, micro-batch 3 (the last is smaller), 2 epochs, 2 calls: 8 optimizer steps
    return [m for seed in (1, 2) for m in engine.train(batch, h.token_mean_loss, 8, 3, epochs=2, seed=seed)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_like_the_torch_engine(stage):
    batch = h.make_batch(16, seed=2)
    reference = create_engine(h.tiny_model(0), EngineConfig(**CFG))
    expected = train_twice(reference, batch)

    start = time.perf_counter()
    engine = create_engine(h.tiny_model(0), EngineConfig(**ds_config(stage)))
    created = time.perf_counter() - start
    initial = h.weights_of(engine)
    got = train_twice(engine, batch)

    assert created < 30, f"creating the engine took {created:.0f} s: did DeepSpeed JIT-build an op?"
    assert engine.optimizer_steps == engine.model.global_steps == 8  # one per mini-batch
    assert engine.steps == 2  # scheduler: once per train call
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], rel=1e-5), key
    assert got[-1]["loss"] < got[0]["loss"]
    h.assert_close(h.weights_of(engine), h.weights_of(reference), atol=1e-6)
    assert all(not torch.equal(initial[k], v) for k, v in h.weights_of(engine).items())


def test_cpu_engine_builds_no_extension():
    import deepspeed.comm.comm as ds_comm

    create_engine(h.tiny_model(0), EngineConfig(**ds_config(1)))
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None  # the shm all-reduce was not compiled


def test_zero3_partitions_and_gathers_full_weights():
    engine = create_engine(h.tiny_model(0), EngineConfig(**ds_config(3)))
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned: nothing local outside a gather
    full = engine.weights()
    h.assert_close(full, h.tiny_model(0).state_dict(), atol=0)  # same keys, full shapes, same values


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_dict_round_trip(stage, tmp_path):
    from rlgraph.runtime.checkpoint import load_state, save_state

    batch = h.make_batch(16, seed=3)
    a = create_engine(h.tiny_model(0), EngineConfig(**ds_config(stage)))
    a.train(batch, h.token_mean_loss, 8, 4, seed=0)
    save_state(a.state_dict(), tmp_path, "engine")
    b = create_engine(h.tiny_model(1), EngineConfig(**ds_config(stage)))  # other weights: all restored
    b.load_state_dict(load_state(tmp_path, "engine"))
    assert (b.steps, b.optimizer_steps, b.lr) == (a.steps, a.optimizer_steps, a.lr)
    h.assert_close(h.weights_of(b), h.weights_of(a), atol=0)
    for e in (a, b):  # moments and master weights restored too: the next step agrees
        e.train(batch, h.token_mean_loss, 8, 4, seed=1)
    h.assert_close(h.weights_of(a), h.weights_of(b), atol=0)


def test_state_from_another_stage_or_backend_is_refused():
    engine = create_engine(h.tiny_model(0), EngineConfig(**ds_config(2)))
    state = engine.state_dict()
    other = create_engine(h.tiny_model(0), EngineConfig(**ds_config(1)))
    with pytest.raises(EngineError, match=r"\(zero_stage: saved 2, this engine 1\); restore with the backend"):
        other.load_state_dict(state)
    with pytest.raises(EngineError, match="backend: saved 'torch', this engine 'deepspeed'"):
        other.load_state_dict(create_engine(h.tiny_model(0), EngineConfig(**CFG)).state_dict())


@pytest.mark.slow
def test_dp2_zero_equals_dp1_torch(tmp_path):
    scs = []
    for stage in (1, 2, 3):
        sc = h.scenarios(ds_config(stage))[0]  # "halves": ragged masks, 2 epochs, 2 calls, micro 3
        scs.append({**sc, "name": f"zero{stage}"})
    start = time.perf_counter()
    results = h.run_ranks(2, scs, tmp_path, timeout_s=300)
    print(f"dp=2 DeepSpeed ZeRO 1-3: {time.perf_counter() - start:.1f} s")
    weights, metrics = h.dp1_reference(h.CFG, scs[0])
    for i, sc in enumerate(scs):
        for r in (results[0][i], results[1][i]):
            assert "error" not in r, r.get("error")
            assert r["optimizer_steps"] == 4
            h.assert_close(r["weights"], weights, atol=1e-6)
            for key in ("grad_norm", "loss"):
                got = [m[key] for call in r["metrics"] for m in call]
                assert got == pytest.approx([m[key] for call in metrics for m in call], rel=1e-5), (sc["name"], key)
