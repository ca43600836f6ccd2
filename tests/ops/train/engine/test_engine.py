"""The training engine, torch backend: step counts, LR schedule, clipping, gradient accumulation,
global token normalisation across ranks (dp=2 on halves == dp=1 on the whole) and per-rank shuffles.

Multi-rank runs start this file as a script, one process per rank (``python test_engine.py
--worker ...``): a plain subprocess needs no importable test package and keeps the pytest
process free of process groups. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[4]
VOCAB, HIDDEN, T = 16, 8, 6


# ---------------------------------------------------------------------------- shared fixtures
def tiny_model(seed: int = 0) -> torch.nn.Module:
    """Next-token model over a 16-token vocabulary: embedding -> tanh MLP -> logits."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, VOCAB))


def make_batch(rows: int, seed: int = 0, lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """`rows` samples with ragged response masks (length 0 = a padding row) and a row id column."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (rows,), generator=g).tolist()
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(0, VOCAB, (rows, T), generator=g), "response_mask": mask,
            "row_id": torch.arange(rows), "length": mask.sum(dim=1)}


def nll(model: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logp = model(mb["input_ids"]).log_softmax(-1)  # [b, T, V]
    target = mb["input_ids"].roll(-1, dims=1)
    return -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [b, T]


def token_mean_loss(model: Any, mb: dict[str, torch.Tensor], global_tokens: int, global_seqs: int):
    """token-mean over the whole mini-batch: this micro-batch's masked sum / the global token count."""
    masked = nll(model, mb) * mb["response_mask"]
    return masked.sum() / global_tokens, {"tokens": float(mb["response_mask"].sum())}


def local_mean_loss(model: Any, mb: dict[str, torch.Tensor], global_tokens: int, global_seqs: int):
    """Wrong on purpose: normalised by this micro-batch's own tokens (shows the dp test can tell)."""
    mask = mb["response_mask"]
    return (nll(model, mb) * mask).sum() / mask.sum().clamp(min=1), {}


def seq_mean_loss(model: Any, mb: dict[str, torch.Tensor], global_tokens: int, global_seqs: int):
    """seq-mean-token-sum: uses the global sequence count."""
    return (nll(model, mb) * mb["response_mask"]).sum() / global_seqs, {}


LOSSES = {"token_mean": token_mean_loss, "local_mean": local_mean_loss, "seq_mean": seq_mean_loss}


def weights_of(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.weights().items()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------------- multi-rank runner
def run_ranks(world_size: int, scenarios: list[dict], tmp_path: Path, timeout_s: float = 240) -> list[dict]:
    """Run `scenarios` in `world_size` rank processes; returns each rank's results (torch.load-ed)."""
    from rlgraph.ops.train.engine import free_port

    port = free_port()
    spec = tmp_path / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world_size), str(port), str(spec),
                               str(tmp_path / f"rank{r}.pt")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world_size)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _worker(rank: int, world_size: int, port: int, spec: str, out: str) -> None:
    """One rank: join the group, run each scenario on this rank's rows, save weights/metrics/orders."""
    from rlgraph.ops.train.engine import EngineConfig, EngineError, TrainEngine, create_engine, init_distributed

    init_distributed(rank, world_size, master_port=port, timeout_s=120)
    results = []
    for sc in json.loads(Path(spec).read_text()):
        engine = create_engine(tiny_model(seed=rank), EngineConfig(**sc["config"]), rank, world_size)
        batch = {k: v[sc["rows"][rank]] for k, v in make_batch(**sc["batch"]).items()}
        seen: list[int] = []
        loss_fn = LOSSES[sc["loss"]]

        def recording(model, mb, global_tokens, global_seqs, loss_fn=loss_fn):
            seen.extend(mb["row_id"].tolist())
            return loss_fn(model, mb, global_tokens=global_tokens, global_seqs=global_seqs)

        result: dict[str, Any] = {"name": sc["name"], "metrics": []}
        try:
            for call in range(sc.get("calls", 1)):
                if call and sc.get("resume"):  # a fresh engine from another init, restored from the state
                    state = engine.state_dict()
                    engine = create_engine(tiny_model(seed=rank + 7), EngineConfig(**sc["config"]), rank, world_size)
                    engine.load_state_dict(state)
                result["metrics"].append(engine.train(batch, recording, **sc["train"]))
        except EngineError as e:
            result["error"] = str(e)
        result["weights"] = weights_of(engine)
        result["seen"] = seen
        result["optimizer_steps"] = engine.optimizer_steps
        results.append(result)
    torch.save(results, out)
    # leave the group together: a rank that exits while gloo still talks to the other one can abort
    # at interpreter exit ("terminate called without an active exception", seen once in CI)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    sys.exit(0)


# ---------------------------------------------------------------------------- tests
import pytest  # noqa: E402

from rlgraph.errors import ConfigError  # noqa: E402
from rlgraph.ops.train.engine import EngineConfig, EngineError, TrainEngine, create_engine, init_distributed, lr_factor  # noqa: E402


def engine_for(model_seed: int = 0, **cfg: Any) -> TrainEngine:
    return create_engine(tiny_model(model_seed), EngineConfig(**cfg))


def test_dp1_steps_lr_warmup_and_weights_change():
    engine = engine_for(lr=1e-2, lr_warmup_steps=4)
    batch = make_batch(16)
    before = weights_of(engine)
    lrs = []
    for call in range(6):
        metrics = engine.train(batch, token_mean_loss, mini_batch_size=4, micro_batch_size=2, epochs=2, seed=call)
        assert len(metrics) == 8  # 16 rows / 4 per mini-batch x 2 epochs: one optimizer step each
        assert engine.optimizer_steps == 8 * (call + 1)
        assert engine.steps == call + 1  # the scheduler moved once per train call ...
        assert len({m["lr"] for m in metrics}) == 1  # ... so every step of a call has the same lr
        lrs.append(metrics[0]["lr"])
        assert set(metrics[0]) == {"loss", "grad_norm", "lr", "tokens", "micro_batches"}
        assert {m["micro_batches"] for m in metrics} == {2}  # 4 rows per mini-batch in micro-batches of 2
    # warm-up over 4 training steps, starting at lr/4 (not 0), then constant
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])
    state = engine.optimizer.state_dict()["state"]
    assert all(int(s["step"]) == 48 for s in state.values())  # AdamW saw 6 x 8 steps
    after = weights_of(engine)
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_loss_metric_and_gradient_are_the_global_token_mean():
    """One mini-batch, no shuffle: the reported loss and the update equal those of a plain masked mean."""
    batch = make_batch(8, seed=3)
    engine = engine_for(lr=1e-2, grad_clip=0.0, weight_decay=0.1)
    reference = tiny_model(0)
    metrics = engine.train(batch, token_mean_loss, mini_batch_size=8, micro_batch_size=3, shuffle=False)

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    mask = batch["response_mask"]
    loss = (nll(reference, batch) * mask).sum() / mask.sum()  # masked_mean over all valid tokens
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    opt.step()
    assert metrics[0]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert metrics[0]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert metrics[0]["tokens"] == pytest.approx(mask.sum().item() / 3)  # mean over the 3 micro-batches
    assert_close(weights_of(engine), reference.state_dict())


def test_gradient_accumulation_matches_one_micro_batch():
    batch = make_batch(8, seed=1)
    results = []
    for micro in (2, 8, 3):  # 3: the last micro-batch is smaller, still the same sum
        engine = engine_for(lr=1e-2)
        engine.train(batch, token_mean_loss, mini_batch_size=8, micro_batch_size=micro, epochs=2, seed=5)
        results.append(weights_of(engine))
    assert_close(results[0], results[1])
    assert_close(results[0], results[2])


def test_grad_clipping_limits_the_norm_the_optimizer_sees():
    seen = {}
    for clip in (0.0, 1e-3):
        engine = engine_for(lr=1e-2, grad_clip=clip)
        norms = []
        engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: norms.append(
            torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters()]).item()))
        metrics = engine.train(make_batch(8), token_mean_loss, mini_batch_size=4, micro_batch_size=4, seed=0)
        seen[clip] = (norms, [m["grad_norm"] for m in metrics])
    norms, reported = seen[0.0]
    assert norms == pytest.approx(reported, rel=1e-5)  # off: the optimizer sees the full gradient
    norms, reported = seen[1e-3]
    assert all(r > 1e-2 for r in reported)  # the reported norm is the one before clipping
    assert norms == pytest.approx([1e-3, 1e-3], rel=1e-3)


def test_non_finite_gradient_skips_the_step():
    engine = engine_for(lr=1e-2)
    before = weights_of(engine)

    def nan_loss(model, mb, global_tokens, global_seqs):
        loss, metrics = token_mean_loss(model, mb, global_tokens, global_seqs)
        return loss * float("nan"), metrics

    metrics = engine.train(make_batch(8), nan_loss, 8, 4)
    assert math.isnan(metrics[0]["grad_norm"])
    assert (engine.optimizer_steps, engine.skipped_steps) == (0, 1)
    assert_close(weights_of(engine), before, atol=0)
    engine.train(make_batch(8), token_mean_loss, 8, 4)  # the poisoned gradient was dropped, not kept
    assert engine.optimizer_steps == 1 and all(torch.isfinite(v).all() for v in weights_of(engine).values())


def test_cosine_schedule_and_lr_factor():
    assert [lr_factor(s, 2, "cosine", 6) for s in range(8)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0])
    assert lr_factor(10, 0, "cosine", 4, min_lr_ratio=0.1) == pytest.approx(0.1)
    engine = engine_for(lr=1.0, lr_warmup_steps=1, lr_schedule="cosine", total_steps=3)
    lrs = [engine.train(make_batch(4), token_mean_loss, 4, 4)[0]["lr"] for _ in range(4)]
    assert lrs == pytest.approx([1.0, 1.0, 0.5, 0.0], abs=1e-12)


def test_default_seed_moves_with_the_step_and_shuffle_is_reproducible():
    orders = []
    for _ in range(2):
        engine = engine_for(seed=7)
        calls: list[list[int]] = []
        for _ in range(2):
            seen: list[int] = []

            def rec(model, mb, global_tokens, global_seqs):
                seen.extend(mb["row_id"].tolist())
                return token_mean_loss(model, mb, global_tokens, global_seqs)

            engine.train(make_batch(8), rec, mini_batch_size=4, micro_batch_size=2, epochs=2)
            calls.append(seen)
        orders.append(calls)
    assert orders[0] == orders[1]  # same config seed: same orders
    first, second = orders[0]
    g = torch.Generator().manual_seed(7)  # step 0, rank 0: config.seed + 0 * world_size + 0
    assert first == torch.randperm(8, generator=g).tolist() + torch.randperm(8, generator=g).tolist()
    assert first[:8] != first[8:]  # epochs reshuffle
    assert first != second  # the next step draws other orders


def test_state_dict_round_trip_through_a_checkpoint(tmp_path):
    from rlgraph.runtime.checkpoint import load_state, save_state

    batch = make_batch(8)
    a = engine_for(lr=1e-2, lr_warmup_steps=3)
    a.train(batch, token_mean_loss, 4, 2, seed=0)
    save_state(a.state_dict(), tmp_path, "engine")
    b = engine_for(model_seed=1, lr=1e-2, lr_warmup_steps=3)  # other initial weights: all of them must be restored
    b.load_state_dict(load_state(tmp_path, "engine"))
    assert (b.steps, b.optimizer_steps, b.lr) == (a.steps, a.optimizer_steps, a.lr)
    for e in (a, b):
        e.train(batch, token_mean_loss, 4, 2, seed=1)
    assert_close(weights_of(a), weights_of(b), atol=0)
    with pytest.raises(EngineError, match="not an engine state"):
        b.load_state_dict({"model": {}})


def test_batch_errors_are_typed_and_say_the_fix():
    engine = engine_for()
    batch = make_batch(6)
    with pytest.raises(EngineError, match=r"rank 0 has 6 rows, not a multiple of mini_batch_size 4; pad"):
        engine.train(batch, token_mean_loss, mini_batch_size=4, micro_batch_size=2)
    with pytest.raises(EngineError, match=r"token_key 'mask' is not in the batch"):
        engine.train(batch, token_mean_loss, 3, 3, token_key="mask")
    with pytest.raises(EngineError, match="disagree on the number of rows"):
        engine.train({**batch, "x": torch.zeros(5)}, token_mean_loss, 3, 3)
    with pytest.raises(EngineError, match=r"must return \(loss tensor, metrics dict\)"):
        engine.train(batch, lambda model, mb, **kw: 1.0, 3, 3)
    with pytest.raises(EngineError, match="must be >= 1"):
        engine.train(batch, token_mean_loss, 3, 0)
    assert engine.optimizer_steps == 0


def test_config_and_create_errors():
    with pytest.raises(ConfigError, match=r"3 problems(.|\n)*lr must be > 0(.|\n)*cosine' needs total_steps"
                                          r"(.|\n)*zero_stage=2 needs backend='deepspeed'"):
        EngineConfig(lr=0, zero_stage=2, lr_schedule="cosine")
    with pytest.raises(EngineError, match=r"call init_distributed\(rank, world_size"):
        create_engine(tiny_model(), EngineConfig(), rank=1, world_size=2)
    with pytest.raises(EngineError, match="needs master_port"):
        init_distributed(0, 2)
    with pytest.raises(EngineError, match="0 <= rank < world_size"):
        create_engine(tiny_model(), EngineConfig(), rank=2, world_size=2)


def test_init_distributed_single_rank_sets_env_without_a_group(monkeypatch):
    import torch.distributed as dist

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed(0, 1) is dist.is_initialized()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert int(os.environ["MASTER_PORT"]) > 0


# ---------------------------------------------------------------------------- dp = 2
# 16 rows; rank 0 holds the long responses, rank 1 the short ones (and two padding rows), so a
# per-rank normalisation would weigh tokens differently from the global one.
LENGTHS = [6, 6, 5, 6, 5, 6, 6, 4, 1, 2, 0, 1, 2, 1, 0, 3]
HALVES = [list(range(8)), list(range(8, 16))]
# 2 mini-batches per rank: global mini-batch k = rank 0's k-th + rank 1's k-th (no shuffle)
INTERLEAVED = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
CFG = {"lr": 1e-2, "lr_warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.01}


def scenarios(config: dict) -> list[dict]:
    base = {"config": config, "batch": {"rows": 16, "seed": 4, "lengths": LENGTHS}, "rows": HALVES, "calls": 2}
    return [
        {**base, "name": "halves", "loss": "token_mean",
         "train": {"mini_batch_size": 8, "micro_batch_size": 3, "epochs": 2, "seed": 11}},
        {**base, "name": "two_mini_batches", "loss": "token_mean",
         "train": {"mini_batch_size": 4, "micro_batch_size": 2, "epochs": 1, "shuffle": False}},
        {**base, "name": "seq_mean", "loss": "seq_mean",
         "train": {"mini_batch_size": 8, "micro_batch_size": 8, "epochs": 1, "seed": 11}},
        {**base, "name": "local_mean", "loss": "local_mean",
         "train": {"mini_batch_size": 8, "micro_batch_size": 8, "epochs": 1, "seed": 11}},
        {**base, "name": "uneven", "loss": "token_mean", "rows": [list(range(8)), list(range(8, 12))],
         "train": {"mini_batch_size": 4, "micro_batch_size": 4}},
    ]


def dp1_reference(config: dict, sc: dict, order: list[int] | None = None) -> tuple[dict[str, torch.Tensor], list]:
    """The same scenario on one rank holding the whole batch (mini-batch = the global one): weights, metrics."""
    engine = create_engine(tiny_model(seed=0), EngineConfig(**config))
    full = make_batch(**sc["batch"])
    batch = {k: v[order] for k, v in full.items()} if order else full
    train = {**sc["train"], "mini_batch_size": 2 * sc["train"]["mini_batch_size"]}
    metrics = [engine.train(batch, LOSSES[sc["loss"]], **train) for _ in range(sc["calls"])]
    return weights_of(engine), metrics


@pytest.fixture(scope="module")
def dp2_torch(tmp_path_factory):
    scs = scenarios(CFG)
    return scs, {pair[0]["name"]: pair for pair in zip(*run_ranks(2, scs, tmp_path_factory.mktemp("dp2")))}


def _by_name(dp2):
    scs, results = dp2
    return {s["name"]: s for s in scs}, results


def test_dp2_on_halves_equals_dp1_on_the_whole_batch(dp2_torch):
    scs, results = _by_name(dp2_torch)
    for name, order in (("halves", None), ("two_mini_batches", INTERLEAVED), ("seq_mean", None)):
        r0, r1 = results[name]
        assert_close(r0["weights"], r1["weights"], atol=0)  # DDP keeps the replicas identical
        weights, metrics = dp1_reference(CFG, scs[name], order)
        assert_close(r0["weights"], weights, atol=1e-6)
        # AdamW hardly sees a constant gradient scale, so check the norm: DDP's average x world_size = the sum
        for r in (r0, r1):
            for key in ("grad_norm", "loss"):
                got = [m[key] for call in r["metrics"] for m in call]
                assert got == pytest.approx([m[key] for call in metrics for m in call], rel=1e-5), (name, key)
    r0, r1 = results["two_mini_batches"]
    assert r0["optimizer_steps"] == r1["optimizer_steps"] == 4  # 2 calls x 2 mini-batches
    # the loss metric is the global mini-batch loss: equal on both ranks
    assert [m["loss"] for m in r0["metrics"][0]] == pytest.approx([m["loss"] for m in r1["metrics"][0]])


def test_dp2_test_detects_a_per_rank_normalisation(dp2_torch):
    scs, results = _by_name(dp2_torch)
    r0, _ = results["local_mean"]
    reference, _ = dp1_reference(CFG, {**scs["local_mean"], "loss": "token_mean"})
    assert any(not torch.allclose(r0["weights"][k], reference[k], atol=1e-5) for k in reference)


def test_dp2_shuffle_is_seeded_by_seed_plus_rank(dp2_torch):
    _, results = _by_name(dp2_torch)
    for rank, r in enumerate(results["halves"]):
        g = torch.Generator().manual_seed(11 + rank)
        epochs = [torch.randperm(8, generator=g) for _ in range(2)]
        expected = [HALVES[rank][i] for e in epochs for i in e.tolist()]
        assert r["seen"] == expected * 2  # two calls with the same explicit seed
    assert results["halves"][0]["seen"][:8] != [i - 8 for i in results["halves"][1]["seen"][:8]]


def test_dp2_uneven_mini_batch_counts_raise_on_every_rank(dp2_torch):
    _, results = _by_name(dp2_torch)
    for r in results["uneven"]:
        assert "ranks got different numbers of mini-batches (rank 0: 2 (8 rows / 4), rank 1: 1 (4 rows / 4))" \
            in r["error"]
        assert r["optimizer_steps"] == 0


# ---------------------------------------------------------------------------- dp = 2, FSDP2 and token budgets
def fsdp2_scenarios() -> list[dict]:
    torch_cfg, fsdp_cfg = dict(CFG), {**CFG, "backend": "fsdp2"}
    base = {"batch": {"rows": 16, "seed": 4, "lengths": LENGTHS}, "rows": HALVES, "calls": 2, "loss": "token_mean"}
    budget = {"mini_batch_size": 8, "micro_batch_size": 8, "epochs": 2, "seed": 11,
              "max_tokens_per_micro_batch": 9, "length_key": "length"}
    return [
        {**base, "config": torch_cfg, "name": "ddp", "train": {"mini_batch_size": 4, "micro_batch_size": 2,
                                                               "epochs": 1, "shuffle": False}},
        {**base, "config": fsdp_cfg, "name": "fsdp2", "train": {"mini_batch_size": 4, "micro_batch_size": 2,
                                                                 "epochs": 1, "shuffle": False}},
        {**base, "config": fsdp_cfg, "name": "fsdp2_resumed", "resume": True,
         "train": {"mini_batch_size": 4, "micro_batch_size": 2, "epochs": 1, "shuffle": False}},
        {**base, "config": torch_cfg, "name": "ddp_rows", "train": {**budget, "max_tokens_per_micro_batch": 0}},
        {**base, "config": torch_cfg, "name": "ddp_budget", "train": budget},
        {**base, "config": fsdp_cfg, "name": "fsdp2_budget", "train": budget},
    ]


@pytest.fixture(scope="module")
def dp2_fsdp2(tmp_path_factory):
    scs = fsdp2_scenarios()
    return scs, {pair[0]["name"]: pair for pair in zip(*run_ranks(2, scs, tmp_path_factory.mktemp("fsdp2")))}


def test_fsdp2_dp2_updates_as_ddp_does(dp2_fsdp2):
    scs, results = _by_name(dp2_fsdp2)
    ddp, fsdp = results["ddp"], results["fsdp2"]
    for r in fsdp:
        assert_close(r["weights"], ddp[0]["weights"], atol=1e-6)  # gathered full weights, equal on both ranks
        for key in ("loss", "grad_norm"):
            assert [m[key] for c in r["metrics"] for m in c] == pytest.approx(
                [m[key] for c in ddp[0]["metrics"] for m in c], rel=1e-5)
    assert fsdp[0]["optimizer_steps"] == 4
    # and both equal one rank on the whole batch
    weights, _ = dp1_reference(CFG, scs["ddp"], INTERLEAVED)
    assert_close(fsdp[0]["weights"], weights, atol=1e-6)


def test_fsdp2_sharded_state_resumes_exactly(dp2_fsdp2):
    _, results = _by_name(dp2_fsdp2)
    for cont, resumed in zip(results["fsdp2"], results["fsdp2_resumed"]):
        assert_close(resumed["weights"], cont["weights"], atol=0)
        assert [m["loss"] for m in resumed["metrics"][1]] == [m["loss"] for m in cont["metrics"][1]]


def test_token_budget_micro_batches_change_nothing_but_the_grouping(dp2_fsdp2):
    _, results = _by_name(dp2_fsdp2)
    rows = results["ddp_rows"][0]
    for name in ("ddp_budget", "fsdp2_budget"):
        for r in results[name]:
            assert_close(r["weights"], rows["weights"], atol=1e-6)
            # 8 rows per rank of at most 6 tokens in 9-token parts: more micro-batches than the 1 of 8 rows,
            # as many on both ranks though rank 1's rows are shorter
            counts = [m["micro_batches"] for c in r["metrics"] for m in c]
            assert counts == [m["micro_batches"] for c in results[name][0]["metrics"] for m in c]
            assert min(counts) > 1
            assert r["seen"] != rows["seen"]  # regrouped by length
