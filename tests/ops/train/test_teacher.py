"""The distillation teacher: refused before anything starts when it cannot score the student's tokens,
and its log-probs those of the teacher model on the student's samples (transformers and vLLM)."""

import pytest
import torch

import rlgraph
from rlgraph import Cluster, Pipeline, PipelineError, WorkerGroup
from rlgraph.ops import stages
from rlgraph.ops.models import build_tiny_model, load_causal_lm
from rlgraph.ops.tokenizers import tokenizer_mismatch
from rlgraph.runtime.invoke import OpContext


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"student": str(build_tiny_model(root / "student", seed=1)),
            "teacher": str(build_tiny_model(root / "teacher", seed=2, hidden_size=128, num_layers=3)),
            "other": str(build_tiny_model(root / "other", chars="0123456789+=xyz ", seed=3))}


def distill(**config):
    return Pipeline(
        name="d", source=stages.prompt_source(),
        ops=[stages.generate(), stages.reward(group="reward"), stages.old_logprob(),
             stages.teacher_logprob(group="teacher"), stages.advantage("distill", group="adv"), stages.update_actor()],
        groups=[WorkerGroup("actor"), WorkerGroup("teacher"), WorkerGroup("reward"), WorkerGroup("adv")],
        cluster=Cluster(num_nodes=1, cpus_per_node=8), config=config)


def test_a_teacher_with_another_tokenizer_is_a_compile_error(models):
    assert tokenizer_mismatch(models["student"], models["teacher"]) is None  # the same character tokenizer
    why = tokenizer_mismatch(models["student"], models["other"])
    assert why and "vocabularies of" in why
    with pytest.raises(PipelineError, match=r"(?s)tokenize differently: vocabularies of .*distil from a teacher with the "
                                            r"student's tokenizer"):
        rlgraph.compile(distill(actor={"model_path": models["student"]}, teacher={"model_path": models["other"]}))
    plan = rlgraph.compile(distill(actor={"model_path": models["student"]}, teacher={"model_path": models["teacher"]}))
    assert [o.name for o in plan.ops if o.name in ("old_logprob", "teacher")] == ["old_logprob", "teacher"]


def test_distillation_needs_a_teacher_and_a_teacher_needs_a_model(models):
    with pytest.raises(PipelineError, match=r"teacher.model_path is empty"):
        rlgraph.compile(distill(actor={"model_path": models["student"]}))
    no_teacher = Pipeline(
        name="d", source=stages.prompt_source(),
        ops=[stages.generate(), stages.reward(group="reward"), stages.old_logprob(),
             stages.advantage("distill", group="adv"), stages.update_actor()],
        groups=[WorkerGroup("actor"), WorkerGroup("reward"), WorkerGroup("adv")],
        cluster=Cluster(num_nodes=1, cpus_per_node=8), config={"actor": {"model_path": models["student"]}})
    with pytest.raises(PipelineError, match=r"(?s)'distill' needs column 'teacher_log_probs'.*stages.teacher_logprob\(\)"):
        rlgraph.compile(no_teacher)


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [5, 3, 7], [4, 0, 6]
    width = max(p + r for p, r in zip(prompts, responses)) + 1
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :p + r] = torch.randint(7, 20, (p + r,), generator=g)
        mask[i, :p + r] = 1
    return ids, mask, responses


def _teacher(models, backend="hf", **teacher):
    from rlgraph.ops.train.teacher import TeacherWorker

    ctx = OpContext(op="teacher", group="teacher", rank=0, dp=1, step=0, chunk=0, seed=0, rows=(0, 1, 2),
                    is_padding=(False,) * 3, config={"actor": {"model_path": models["student"]},
                                                     "teacher": {"model_path": models["teacher"], "backend": backend,
                                                                 **teacher}})
    w = TeacherWorker()
    w.setup(ctx)
    return w


def _score(w, ids, mask, responses, column="teacher_log_probs"):
    ctx = OpContext(op="teacher", group="teacher", rank=0, dp=1, step=0, chunk=0, seed=0, rows=(0, 1, 2),
                    is_padding=(False,) * 3, lengths={"response_len": tuple(responses)})
    R = max(responses)
    out = w.compute_teacher_log_prob(ids, mask, mask.cumsum(1) - 1, ids[:, :R], mask[:, :R], ctx=ctx)
    return out[column] if isinstance(column, str) else [out[c] for c in column]


def test_teacher_log_probs_are_the_teacher_model_s(models):
    ids, mask, responses = _rows()
    got = _score(_teacher(models), ids, mask, responses)
    teacher = load_causal_lm(models["teacher"])
    for i, r in enumerate(responses):
        n = int(mask[i].sum())
        with torch.no_grad():
            logp = teacher(input_ids=ids[i:i + 1, :n]).logits[0].log_softmax(-1)
        p = n - r
        want = torch.stack([logp[p - 1 + t, ids[i, p + t]] for t in range(r)]) if r else torch.zeros(0)
        torch.testing.assert_close(got[i, :r], want, atol=1e-5, rtol=1e-5)
        assert bool((got[i, r:] == 0).all())


def test_teacher_top_k_is_the_teacher_model_s_most_likely_tokens(models):
    ids, mask, responses = _rows()
    lp, top_ids, top_lp = _score(_teacher(models, top_k=4), ids, mask, responses,
                                 ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs"))
    torch.testing.assert_close(lp, _score(_teacher(models), ids, mask, responses))
    assert top_ids.shape == top_lp.shape == (3, max(responses), 4) and top_ids.dtype == torch.long
    teacher = load_causal_lm(models["teacher"])
    for i, r in enumerate(responses):
        n, p = int(mask[i].sum()), int(mask[i].sum()) - r
        with torch.no_grad():
            logp = teacher(input_ids=ids[i:i + 1, :n]).logits[0].log_softmax(-1)[p - 1:n - 1]  # predicts the response
        want_lp, want_ids = logp.topk(4, dim=-1)
        assert torch.equal(top_ids[i, :r], want_ids)
        torch.testing.assert_close(top_lp[i, :r], want_lp, atol=1e-5, rtol=1e-5)
        assert bool((top_lp[i, r:] == 0).all()) and bool((top_ids[i, r:] == 0).all())
    # without top_k the columns are empty (and pruned from the data plane: nothing reads them)
    assert _score(_teacher(models), ids, mask, responses, "teacher_topk_ids").shape == (3, max(responses), 0)


def test_the_dense_distillation_loss_is_checked_at_compile_time(models):
    paths = {"actor": {"model_path": models["student"]}, "teacher": {"model_path": models["teacher"]}}
    with pytest.raises(PipelineError, match=r"(?s)actor.distill_coef > 0, but teacher.top_k=0.*set teacher.top_k"):
        rlgraph.compile(distill(actor={**paths["actor"], "distill_coef": 1.0}, teacher=paths["teacher"]))
    with pytest.raises(PipelineError, match=r"(?s)make every advantage 0.*learn nothing"):
        rlgraph.compile(distill(**paths, algorithm={"distill_kl_weight": 0.0}))
    plan = rlgraph.compile(distill(actor={**paths["actor"], "distill_coef": 1.0},
                                   teacher={**paths["teacher"], "top_k": 8}, algorithm={"distill_kl_weight": 0.0}))
    assert plan.columns["teacher_topk_log_probs"].stored and "update_actor" in plan.columns[
        "teacher_topk_ids"].consumers
    plain = rlgraph.compile(distill(**paths))
    assert not plain.columns["teacher_topk_ids"].stored  # nobody reads them: never put
    no_teacher = Pipeline(
        name="d", source=stages.prompt_source(),
        ops=[stages.generate(), stages.reward(group="reward"), stages.advantage("grpo", group="adv"),
             stages.update_actor()],
        groups=[WorkerGroup("actor"), WorkerGroup("reward"), WorkerGroup("adv")],
        cluster=Cluster(num_nodes=1, cpus_per_node=8), config={"actor": {**paths["actor"], "distill_coef": 0.5}})
    with pytest.raises(PipelineError, match=r"(?s)needs the teacher's top-k distribution.*stages.teacher_logprob\(\) "
                                            r"with teacher.top_k > 0"):
        rlgraph.compile(no_teacher)


def test_the_worker_refuses_another_tokenizer_at_start(models):
    from rlgraph.ops.train.teacher import TeacherError, TeacherWorker

    ctx = OpContext(op="teacher", group="teacher", rank=0, dp=1, step=0, chunk=0, seed=0, rows=(), is_padding=(),
                    config={"actor": {"model_path": models["student"]}, "teacher": {"model_path": models["other"]}})
    with pytest.raises(TeacherError, match="tokenize differently"):
        TeacherWorker().setup(ctx)


@pytest.mark.vllm
def test_a_vllm_teacher_gives_the_transformers_teacher_s_log_probs(models):
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    ids, mask, responses = _rows(seed=3)
    hf = _score(_teacher(models), ids, mask, responses)
    w = _teacher(models, backend="vllm")
    try:
        got = _score(w, ids, mask, responses)
    finally:
        w.close()
    torch.testing.assert_close(got, hf, atol=2e-3, rtol=1e-3)


@pytest.mark.vllm
def test_a_vllm_teacher_gives_the_transformers_teacher_s_top_k(models):
    """vLLM's prompt log-probs with their top-k: the same tokens and log-probs as the transformers teacher's
    (a k beyond vLLM's default cap of 20 included)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    ids, mask, responses = _rows(seed=3)
    cols = ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs")
    hf = _score(_teacher(models, top_k=24), ids, mask, responses, cols)
    w = _teacher(models, backend="vllm", top_k=24)
    try:
        got = _score(w, ids, mask, responses, cols)
    finally:
        w.close()
    torch.testing.assert_close(got[0], hf[0], atol=2e-3, rtol=1e-3)
    assert got[1].shape == hf[1].shape == (3, max(responses), 24)
    real = torch.zeros(3, max(responses), dtype=torch.bool)
    for i, r in enumerate(responses):
        real[i, :r] = True
    torch.testing.assert_close(got[2][real], hf[2][real], atol=2e-3, rtol=1e-3)  # the k best log-probs
    # and vLLM's tokens are the ones with those log-probs under transformers (near-ties may swap places)
    full = _score(_teacher(models, top_k=1000), ids, mask, responses, cols)  # the whole vocabulary
    for i, t in real.nonzero().tolist():
        lp_of = dict(zip(full[1][i, t].tolist(), full[2][i, t].tolist()))
        want = torch.tensor([lp_of[tok] for tok in got[1][i, t].tolist()])
        torch.testing.assert_close(got[2][i, t], want, atol=2e-3, rtol=1e-3)
        assert len(set(got[1][i, t].tolist())) == 24


@pytest.mark.ray
def test_the_distill_example_streams_the_teacher_and_schedules_agree(models, tq_plane, tmp_path):
    """examples/distill.py on Ray and TransferQueue: the teacher scores each group as it is generated, its top-k
    columns ([R, k] per sample) reach the update's dense loss through the data plane, and stream == sync (with
    the task reward mixed in)."""
    import math
    from pathlib import Path

    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.runner import RunOptions, run_plan

    pipeline, ref = load_pipeline(str(Path(__file__).parents[3] / "examples" / "distill.py"))
    plan = rlgraph.compile(pipeline, [f"actor.model_path={models['student']}", f"teacher.model_path={models['teacher']}",
                                      "data.batch_size=4", "rollout.n=4", "actor.mini_batch_size=4",
                                      "algorithm.distill_task_weight=0.5", "data.num_rows=64"], pipeline_ref=ref)
    assert "old_logprob" in [o.name for o in plan.ops]  # the advantage reads old_log_probs: never reused away
    runs = {s: run_plan(plan, RunOptions(out_dir=tmp_path / s, steps=2, schedule=s, timeout_s=300), plane=tq_plane)
            for s in ("stream", "sync")}
    volatile = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/")
    stable = {s: [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in recs] for s, recs in runs.items()}
    assert stable["stream"] == stable["sync"]
    for rec in runs["stream"]:
        assert math.isfinite(rec["advantage/advantage_metrics/reverse_kl/mean"])
        assert rec["load/teacher/rank_0/rows"] == 16 and rec["samples/trained"] == 16
        assert math.isfinite(rec["update_actor/actor_metrics/loss"])
        assert rec["update_actor/actor_metrics/distill_loss"] > 0  # the example's GKD loss (teacher.top_k=64)
