"""Chunked log-probs and entropy, padded and packed layouts: the same numbers and gradients as the
full logits, with no padding token computed and attention kept within each packed sequence."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlgraph.ops.algos import entropy_from_logits, logprobs_from_logits
from rlgraph.ops.train.logprobs import (enable_token_logprobs, fused_supported, packed_layout, padded_layout,
                                        response_logprobs, response_scores)
from rlgraph.ops.train.sequences import repack, response_logits

V = 40


def model(arch: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, pad_token_id=0)
    return Qwen2ForCausalLM(Qwen2Config(**kw)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**kw))


def rows(prompts=(3, 5, 2, 4), responses=(6, 1, 3, 0), seed=1):
    """Right-padded prompt+response rows (verl's stored layout), as the ops receive them."""
    g = torch.Generator().manual_seed(seed)
    width = max(p + r for p, r in zip(prompts, responses)) + 2
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :p + r] = torch.randint(1, V, (p + r,), generator=g)
        mask[i, :p + r] = 1
    return repack(ids, mask, list(responses), 0)


def reference(m, packed, temperature=0.7):
    logits = response_logits(m, packed, temperature)
    return (logprobs_from_logits(logits, packed.input_ids[:, packed.prompt_width:]) * packed.response_mask,
            entropy_from_logits(logits) * packed.response_mask)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk", [1, 3, 0])
def test_both_layouts_equal_the_full_logits(arch, chunk):
    m = model(arch)
    packed = rows()
    ref_logp, ref_ent = reference(m, packed)
    assert enable_token_logprobs(m) and enable_token_logprobs(m)  # idempotent
    for name, layout in (("padded", padded_layout(packed)), ("packed", packed_layout(packed))):
        logp, ent = response_logprobs(m, layout, 0.7, chunk, with_entropy=True)
        torch.testing.assert_close(logp * packed.response_mask, ref_logp, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(ent * packed.response_mask, ref_ent, atol=2e-6, rtol=1e-5)
        assert logp.shape == ref_logp.shape
        if name == "packed":  # nothing computed past a response (padded: computed, and masked by the caller)
            assert bool((logp[packed.response_mask == 0] == 0).all())


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("chunk", [2, 0])
def test_top_k_and_the_log_probs_of_given_ids_are_the_full_distribution_s(chunk, softcap):
    """A teacher's top-k (ids and log-probs) and a student's log-probs at those ids, from the same logits
    block, in both layouts and on the full-logits path; the student's gradient as the full logits give it."""
    m = model()
    if softcap:
        m.config.final_logit_softcapping = 30.0
    enable_token_logprobs(m)
    packed = rows()
    full = response_logits(m, packed, 0.7).log_softmax(-1)  # [b, R, V]
    want_lp, want_ids = full.topk(5, dim=-1)
    mask = packed.response_mask.bool()
    for layout in (padded_layout(packed), packed_layout(packed)):
        with torch.no_grad():
            s = response_scores(m, layout, 0.7, chunk, top_k=5)
        assert s.side_logp.shape == s.side_ids.shape == (*packed.response_mask.shape, 5)
        assert torch.equal(s.side_ids[mask], want_ids[mask])
        torch.testing.assert_close(s.side_logp[mask], want_lp[mask].detach(), atol=2e-6, rtol=1e-5)
        assert response_scores(m, layout, 0.7, chunk, top_k=V + 10).side_ids.shape[-1] == V  # k past the vocabulary
    ids = torch.randint(0, V, (*packed.response_mask.shape, 3), generator=torch.Generator().manual_seed(4))
    at = response_scores(m, packed_layout(packed), 0.7, chunk, at_ids=ids).side_logp
    assert at.requires_grad and at.shape == ids.shape
    torch.testing.assert_close(at[mask], full.gather(-1, ids)[mask], atol=2e-6, rtol=1e-5)
    # gradients: the chunked (checkpointed) path and the full logits agree
    weights = torch.randn(at.shape, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    grads = []
    for value in (at, full.gather(-1, ids)):
        m.zero_grad()
        (value * weights).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_layout_computes_only_real_tokens_with_positions_restarting():
    packed = rows()
    layout = packed_layout(packed)
    assert layout.tokens == 3 + 6 + 5 + 1 + 2 + 3 + 4 + 0 == int(packed.attention_mask.sum())
    assert padded_layout(packed).tokens == 4 * (5 + 6)  # the padded batch: 4 rows x (P + R)
    assert layout.attention_mask is None
    assert layout.position_ids[0].tolist() == [*range(9), *range(6), *range(5), *range(4)]


def test_packed_sequences_do_not_attend_to_each_other():
    m = model()
    enable_token_logprobs(m)
    a, b = rows(seed=1), rows(seed=2)
    # row 1 of a and b differ; row 0 is the same in both: its log-probs must not move
    same = a.input_ids.clone()
    same[1:] = b.input_ids[1:]
    mixed = a._replace(input_ids=same)
    la, _ = response_logprobs(m, packed_layout(a), 1.0)
    lb, _ = response_logprobs(m, packed_layout(mixed), 1.0)
    assert torch.equal(la[0], lb[0]) and not torch.equal(la[2], lb[2])


def test_gradients_equal_the_full_logits_path():
    m = model()
    packed = rows()
    ref_logp, ref_ent = reference(m, packed)
    (ref_logp.sum() + ref_ent.sum()).backward()
    expected = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    enable_token_logprobs(m)
    logp, ent = response_logprobs(m, packed_layout(packed), 0.7, chunk=2, with_entropy=True)
    ((logp * packed.response_mask).sum() + (ent * packed.response_mask).sum()).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=1e-4, msg=n)


def test_generation_is_the_model_s_own_after_enabling():
    m = model()
    prompt = torch.tensor([[1, 2, 3]])
    before = m.generate(prompt, max_new_tokens=5, do_sample=False)
    enable_token_logprobs(m)
    assert torch.equal(m.generate(prompt, max_new_tokens=5, do_sample=False), before)


def test_a_model_with_soft_capped_logits_takes_the_full_logits_path():
    m = model()
    m.config.final_logit_softcapping = 30.0  # the head is not plain output_embeddings(hidden) any more
    assert not fused_supported(m)
    assert not enable_token_logprobs(m)
    packed = rows()
    ref_logp, _ = reference(m, packed)
    logp, _ = response_logprobs(m, padded_layout(packed), 0.7)
    torch.testing.assert_close(logp * packed.response_mask, ref_logp)


def test_a_response_without_a_prompt_token_is_refused():
    packed = rows(prompts=(0, 2), responses=(3, 1))
    with pytest.raises(ValueError, match="without a prompt token"):
        packed_layout(packed)
