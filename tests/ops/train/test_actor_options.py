"""The policy worker with the engine options on: packed and token-budget updates equal the padded
ones, LoRA trains only adapters with the base as the reference, and log-prob passes split by tokens.

The worker is called directly (one rank, no Ray), as the runtime calls it; tests/ops/train/
test_options_e2e.py runs the same options through Ray and TransferQueue."""

import pytest
import torch

from rlgraph.graph.plan import OpBatching
from rlgraph.ops.models import build_tiny_model, load_causal_lm
from rlgraph.ops.train.actor import ActorWorker
from rlgraph.runtime.invoke import OpContext

pytest.importorskip("peft")

# skewed: responses 1..24 tokens, prompts 3..9
PROMPTS = [3, 9, 4, 5, 7, 3, 8, 6]
RESPONSES = [24, 1, 2, 17, 3, 1, 9, 2]
B = len(PROMPTS)
UPDATE = dict(lr=1e-2, weight_decay=0.0, grad_clip=1.0, lr_warmup_steps=0, backend="torch", zero_stage=0,
              loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
              loss_mode="vanilla", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
              tis_cap=0.0, decoupled_cap=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=3))


def ctx_for(model_dir, op="update_actor", micro=2, impls=("rlgraph.ops.train.actor:ActorWorker.update_actor",),
            **actor):
    config = {"actor": {"model_path": model_dir, **actor}, "rollout": {"temperature": 1.0}, "trainer": {"seed": 0}}
    batching = OpBatching(dp=1, samples_per_rank=B, rank_mini_batch=[B, B], micro_batch_size=micro, epochs=1,
                          updates_per_step=1)
    return OpContext(op=op, group="actor", rank=0, dp=1, step=0, chunk=0, seed=1, rows=tuple(range(B)),
                     is_padding=(False,) * (B - 1) + (True,), config=config, batching=batching,
                     lengths={"response_len": tuple(RESPONSES)}, group_impls=impls)


def worker(model_dir, **actor):
    w = ActorWorker()
    w.setup(ctx_for(model_dir, **actor))
    return w


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(p + r for p, r in zip(PROMPTS, RESPONSES)) + 3
    R = max(RESPONSES) + 2
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids[i, :p + r] = torch.randint(4, 30, (p + r,), generator=g)
        mask[i, :p + r] = 1
        response_mask[i, :r] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1,
            "responses": ids[:, :R], "response_mask": response_mask,
            "advantages": torch.randn(B, R, generator=g) * response_mask}


def update(w, cols, model_dir, micro=2, budget=0, **actor):
    ref = w.compute_ref_log_prob(**{k: cols[k] for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                                         "response_mask")}, ctx=ctx_for(model_dir, "ref", **actor))
    out = w.update_actor(**cols, ref_log_prob=ref["ref_log_prob"], ctx=ctx_for(model_dir, micro=micro, **actor),
                         max_tokens_per_micro_batch=budget, **UPDATE)
    return out["actor_metrics"], ref["ref_log_prob"]


def recorded_gradients(monkeypatch):
    """Every AdamW step's gradients, in parameter order (AdamW's sign-like first step would turn float noise
    in a near-zero gradient into a visible weight difference: compare what it was given)."""
    steps = []
    original = torch.optim.AdamW.step

    def step(self, *a, **kw):
        steps.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None])
        return original(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return steps


def test_packed_token_budget_update_equals_the_padded_one(model_dir, monkeypatch):
    cols = batch()
    plain, packed = worker(model_dir), worker(model_dir, packing=True, logprob_chunk_size=5)
    grads = recorded_gradients(monkeypatch)
    m_plain, ref_plain = update(plain, cols, model_dir, micro=2)
    m_packed, ref_packed = update(packed, cols, model_dir, budget=12, packing=True, logprob_chunk_size=5)
    torch.testing.assert_close(ref_packed, ref_plain, atol=1e-5, rtol=1e-5)
    # the global loss and gradient (pg_loss, kl_loss, entropy are means of micro-batch means: grouping moves them)
    for key in ("loss", "grad_norm"):
        assert m_packed[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key
    (g_plain,), (g_packed,) = grads[:1], grads[1:]
    assert len(g_plain) == len(g_packed) > 10
    for a, b in zip(g_packed, g_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # no padding computed: the packed forward costs the real tokens of the rows with a loss (the padding row
    # is left out); the padded one the whole [rows, P + R] block
    real = sum(p + r for p, r in zip(PROMPTS[:-1], RESPONSES[:-1]))
    assert m_packed["forward_tokens"] == real and m_plain["padded_tokens"] == B * (9 + 24)
    assert m_packed["micro_batches"] >= 96 // 12 > m_plain["micro_batches"] == 4  # 96 real tokens in parts of 12


def test_log_prob_passes_split_by_tokens_give_the_same_numbers(model_dir):
    cols = {k: v for k, v in batch().items() if k != "advantages"}
    w = worker(model_dir, packing=True)
    one = w.compute_log_prob(**cols, compare_rollout=False, ctx=ctx_for(model_dir, "old_logprob"))
    split = w.compute_log_prob(**cols, compare_rollout=False, max_tokens_per_micro_batch=20,
                               ctx=ctx_for(model_dir, "old_logprob"))
    torch.testing.assert_close(split["old_log_probs"], one["old_log_probs"], atol=1e-6, rtol=1e-5)
    real = torch.zeros_like(one["old_log_probs"])
    for i, r in enumerate(RESPONSES):
        real[i, :r] = 1
    assert bool((one["old_log_probs"][real == 0] == 0).all()) and bool((one["old_log_probs"][real == 1] < 0).all())


def test_lora_trains_adapters_only_and_the_reference_is_the_base(model_dir):
    cols = batch()
    w = worker(model_dir, lora_rank=4, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")
    base = load_causal_lm(model_dir)
    trainable = {n for n, p in w.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    for _ in range(2):
        metrics, ref = update(w, cols, model_dir, lora_rank=4, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")
    changed = {n for n, p in w.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # the base never moves
    # the reference is the base model: the plain worker's reference log-probs
    plain = worker(model_dir)
    _, ref_plain = update(plain, batch(), model_dir)
    torch.testing.assert_close(ref, ref_plain, atol=1e-5, rtol=1e-5)
    # the policy moved away from it (KL > 0 after two updates), and what others get is the merged policy
    assert metrics["kl_loss"] > 0
    merged = w._weights(step=1)["state"]
    assert set(merged) == set(base.state_dict())
    base.load_state_dict(merged)
    x = cols["input_ids"][:2, :8]
    torch.testing.assert_close(base(x).logits, w.model(input_ids=x).logits, atol=1e-5, rtol=1e-4)
    # checkpoints hold the adapters only, and restore them into a fresh worker
    state = w.state_dict()
    assert set(state["model"]) == trainable
    fresh = worker(model_dir, lora_rank=4, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")
    fresh.load_state_dict(state)
    for n, p in fresh.model.named_parameters():
        assert torch.equal(p, dict(w.model.named_parameters())[n]), n


def test_lora_names_a_module_the_model_lacks(model_dir):
    from rlgraph.errors import ConfigError

    with pytest.raises(ConfigError, match=r"names \['qkv'\].*linear layers are \['down_proj'"):
        worker(model_dir, lora_rank=4, lora_target_modules="qkv")


def test_a_generation_only_group_gets_no_adapters(model_dir):
    w = ActorWorker()
    w.setup(ctx_for(model_dir, impls=("rlgraph.ops.train.actor:ActorWorker.generate",), lora_rank=4))
    assert all(p.requires_grad for p in w.model.parameters()) and not any(".lora_" in n for n, _ in
                                                                          w.model.named_parameters())


def test_the_adapter_export_loads_in_peft_as_the_trained_policy(model_dir, tmp_path):
    from peft import PeftModel

    from rlgraph.ops.train.lora import save_adapter

    w = worker(model_dir, lora_rank=4, lora_alpha=8.0)
    update(w, batch(), model_dir, lora_rank=4, lora_alpha=8.0)
    save_adapter(w.model, tmp_path / "adapter", model_dir)
    loaded = PeftModel.from_pretrained(load_causal_lm(model_dir), str(tmp_path / "adapter")).eval()
    x = batch()["input_ids"][:2, :8]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, w.model(input_ids=x).logits, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_recomputes_without_changing_the_gradient(model_dir, monkeypatch):
    cols = batch()
    plain, ckpt = worker(model_dir), worker(model_dir, gradient_checkpointing=True)
    assert ckpt.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    grads = recorded_gradients(monkeypatch)
    m_plain, _ = update(plain, cols, model_dir)
    m_ckpt, _ = update(ckpt, cols, model_dir, gradient_checkpointing=True)
    assert m_ckpt["loss"] == pytest.approx(m_plain["loss"], rel=1e-6)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("packing", [False, True])
def test_the_dense_distillation_loss_is_gkd_s_divergence_to_the_teacher(model_dir, tmp_path, packing):
    """actor.distill_coef: with zero advantages the update's loss is the token-mean JSD_beta between the
    student's next-token distributions (before the step) and the teacher's top-k plus tail, as worked
    from the two models' full logits; and it moves the student towards the teacher."""
    from rlgraph.ops.algos import top_k_distill_loss
    from rlgraph.ops.train.sequences import repack, response_logits

    teacher = load_causal_lm(build_tiny_model(tmp_path / "teacher", seed=9, hidden_size=32))
    cols = batch()
    cols["advantages"] = torch.zeros_like(cols["advantages"])
    packed = repack(cols["input_ids"], cols["attention_mask"], RESPONSES, 0)
    with torch.no_grad():
        t_full = response_logits(teacher, packed, 1.0).log_softmax(-1)
        s_full = response_logits(load_causal_lm(model_dir), packed, 1.0).log_softmax(-1)
    top_lp, top_ids = t_full.topk(6, dim=-1)
    R = cols["response_mask"].shape[1]
    pad = R - top_ids.shape[1]  # the stored columns are as wide as the response mask
    top_ids, top_lp = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (top_ids, top_lp))
    mask = cols["response_mask"].float()
    mask[-1] = 0  # the last row is padding (ctx_for)
    want, _ = top_k_distill_loss(s_full.gather(-1, top_ids[:, :s_full.shape[1]]), top_lp[:, :s_full.shape[1]],
                                 mask[:, :s_full.shape[1]], beta=0.3)
    options = dict(packing=True, logprob_chunk_size=5) if packing else {}
    w = worker(model_dir, **options)
    update_args = {**UPDATE, "entropy_coeff": 0.0, "use_kl_loss": False, "lr": 1e-3}
    out = w.update_actor(**cols, teacher_topk_ids=top_ids, teacher_topk_log_probs=top_lp, distill_coef=2.0,
                         distill_beta=0.3, ctx=ctx_for(model_dir, **options), **update_args)["actor_metrics"]
    assert out["loss"] == pytest.approx(2.0 * float(want), rel=1e-5)
    assert out["pg_loss"] == 0.0 and out["distill_loss"] > 0
    after = w.update_actor(**cols, teacher_topk_ids=top_ids, teacher_topk_log_probs=top_lp, distill_coef=2.0,
                           distill_beta=0.3, ctx=ctx_for(model_dir, **options), **update_args)["actor_metrics"]
    assert after["loss"] < out["loss"]  # one step towards the teacher


@pytest.mark.parametrize("micro,budget,loss_mode", [
    (B, 0, "vanilla"),  # one forward over every row
    (2, 0, "vanilla"),  # micro-batches of rows
    (B, 12, "vanilla"),  # a token budget that splits the rows
    (B, 10_000, "vanilla"),  # a token budget that holds them all: one forward
    (B, 0, "gspo"),  # sequence-level ratio: the sequence count, too, after the drops
    (2, 0, "gspo"),
])
@pytest.mark.parametrize("correction", ["tis_cap", "decoupled_cap"])
def test_rollout_corrections_without_old_log_probs_equal_the_separate_pass(model_dir, monkeypatch, correction,
                                                                          micro, budget, loss_mode):
    # the compiler leaves old_logprob out (rlgraph.graph.reuse): truncated IS weighs each micro-batch by its own
    # forward; decoupled PPO takes its proximal log-probs from the forward when it sees every row, else from a pass
    # the update makes itself. Either way the gradient and the drops are those of the separate pass
    cols = batch(seed=1)
    lp_cols = {k: cols[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    probe = worker(model_dir)
    old = probe.compute_log_prob(**lp_cols, compare_rollout=False, ctx=ctx_for(model_dir, "old_logprob"))
    old = old["old_log_probs"]
    # a behaviour policy off by up to ~2 nats per token: with cap 2, some tokens' weights exceed it
    noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    noise[1] = -3.0  # row 1 (one token) dropped whole: the sequence count changes too (GSPO normalises by it)
    rollout = (old + noise * cols["response_mask"][:, :old.shape[1]]).detach()
    settings = {**UPDATE, correction: 2.0, "max_tokens_per_micro_batch": budget, "loss_mode": loss_mode}
    grads = recorded_gradients(monkeypatch)
    passes = []
    proximal = ActorWorker._proximal
    monkeypatch.setattr(ActorWorker, "_proximal", lambda self, *a: passes.append(1) or proximal(self, *a))
    out = {}
    for name, given in (("separate", old), ("own", None)):
        w = worker(model_dir)
        ref = w.compute_ref_log_prob(**lp_cols, ctx=ctx_for(model_dir, "ref"))["ref_log_prob"]
        extra = {"old_log_probs": given} if given is not None else {}
        out[name] = w.update_actor(**cols, ref_log_prob=ref, rollout_log_probs=rollout, **extra,
                                   ctx=ctx_for(model_dir, micro=micro), **settings)["actor_metrics"]
    (g_sep,), (g_own,) = grads[:1], grads[1:]
    assert len(g_own) == len(g_sep) > 10
    for a, b in zip(g_own, g_sep):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    weight = "tis_weight_mean" if correction == "tis_cap" else "behaviour_weight_mean"
    for key in ("loss", "grad_norm", weight):
        assert out["own"][key] == pytest.approx(out["separate"][key], rel=1e-5, abs=1e-6), key
    if correction == "decoupled_cap":
        dropped = out["separate"]["behaviour_dropped_frac"]
        assert 0.05 < dropped < 0.9 and out["own"]["behaviour_dropped_frac"] == pytest.approx(dropped, abs=1e-6)
        assert out["own"]["micro_batches"] == out["separate"]["micro_batches"]
    # a pass of the update's own only where the forward does not see every row (decoupled PPO's drops)
    one_forward = (budget == 0 and micro == B) or (budget and out["own"]["micro_batches"] == 1)
    assert len(passes) == (correction == "decoupled_cap" and not one_forward)
