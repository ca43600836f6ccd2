"""GKD's divergence over the teacher's top-k plus the tail: worked by hand, equal to the full-vocabulary
divergence when k is the vocabulary, never above it otherwise, and masked like every other loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlgraph.ops.algos import generalized_jsd, top_k_distill_loss, with_tail


def test_one_token_and_its_tail_by_hand():
    # teacher: 0.5 on the token (tail 0.5); student: 0.25 (tail 0.75)
    s, t = torch.tensor([[[math.log(0.25)]]]), torch.tensor([[[math.log(0.5)]]])
    mask = torch.ones(1, 1)
    forward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(T || S) = 0.143841
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(S || T) = 0.130812
    m = (0.375, 0.625)  # M = (T + S) / 2
    jsd = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])) \
        + 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1]))  # 0.033822
    for beta, want in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
        loss, per_token = top_k_distill_loss(s, t, mask, beta=beta)
        assert float(loss) == pytest.approx(want, abs=1e-6), beta
        assert per_token.shape == (1, 1)
    assert forward == pytest.approx(0.143841, abs=1e-6) and jsd == pytest.approx(0.033822, abs=1e-6)


def test_k_at_the_vocabulary_is_the_full_divergence():
    g = torch.Generator().manual_seed(0)
    student_logits, teacher_logits = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g) * 3
    s_all, t_all = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    ids = t_all.topk(11, dim=-1).indices  # every token, the teacher's order
    s, t = s_all.gather(-1, ids), t_all.gather(-1, ids)
    mask = torch.ones(2, 3)
    # torch's kl_div(input=log Q, target=log P, log_target) is KL(P || Q)
    forward = F.kl_div(s_all, t_all, log_target=True, reduction="none").sum(-1)
    reverse = F.kl_div(t_all, s_all, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(top_k_distill_loss(s, t, mask, beta=0.0)[1], forward, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(top_k_distill_loss(s, t, mask, beta=1.0)[1], reverse, atol=1e-5, rtol=1e-5)
    m = ((s_all.exp() + t_all.exp()) / 2).log()
    jsd = 0.5 * F.kl_div(m, t_all, log_target=True, reduction="none").sum(-1) \
        + 0.5 * F.kl_div(m, s_all, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(top_k_distill_loss(s, t, mask, beta=0.5)[1], jsd, atol=1e-5, rtol=1e-5)
    # and its gradient is finite although the tail is empty
    s.requires_grad_(True)
    top_k_distill_loss(s, t, mask, beta=0.5)[0].backward()
    assert bool(torch.isfinite(s.grad).all())


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_top_k_never_exceeds_the_full_divergence(beta):
    g = torch.Generator().manual_seed(1)
    s_all = (torch.randn(4, 5, 30, generator=g) * 2).log_softmax(-1)
    t_all = (torch.randn(4, 5, 30, generator=g) * 2).log_softmax(-1)
    ids = t_all.topk(30, dim=-1).indices
    full = generalized_jsd(s_all, t_all, beta)
    for k in (1, 4, 12, 30):
        part = top_k_distill_loss(s_all.gather(-1, ids[..., :k]), t_all.gather(-1, ids[..., :k]), torch.ones(4, 5),
                                  beta=beta)[1]
        assert bool((part <= full + 1e-5).all()), k  # coarsening never adds divergence (data processing)
    torch.testing.assert_close(part, full, atol=1e-5, rtol=1e-5)


def test_masked_tokens_count_for_nothing_and_beta_is_checked():
    s = torch.log(torch.tensor([[[0.2, 0.1], [0.5, 0.4]]]))
    t = torch.log(torch.tensor([[[0.6, 0.3], [0.0001, 0.9]]]))
    loss, per_token = top_k_distill_loss(s, t, torch.tensor([[1.0, 0.0]]), beta=0.0)
    assert float(loss) == pytest.approx(float(per_token[0, 0]))
    t_pad = t.clone()
    t_pad[0, 1] = 0.0  # what the teacher writes past a response: log-probs 0 (a tail clamped, all finite)
    assert float(top_k_distill_loss(s, t_pad, torch.tensor([[1.0, 0.0]]), beta=0.5)[0]) == pytest.approx(
        float(top_k_distill_loss(s, t, torch.tensor([[1.0, 0.0]]), beta=0.5)[0]))
    with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\]"):
        generalized_jsd(s, t, 1.5)
    with pytest.raises(ValueError, match="do not match response_mask"):
        top_k_distill_loss(s, t, torch.ones(2, 2))
    assert with_tail(torch.log(torch.tensor([0.25, 0.25]))).exp().tolist() == pytest.approx([0.25, 0.25, 0.5])


def test_slots_the_student_cannot_score_carry_no_probability_and_tails_are_floored():
    from rlgraph.ops.algos import drop_unusable, usable_ids
    from rlgraph.ops.algos.distill import NO_TOKEN, TAIL_FLOOR

    # a teacher with a larger vocabulary ranks token 12 (the student has 10) and an engine gave only 2 of 3
    ids = torch.tensor([[[3, 12, NO_TOKEN]]])
    t = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    gather_ids, t_ok, ok = usable_ids(ids, t, vocab_size=10)
    assert gather_ids.tolist() == [[[3, 0, 0]]] and ok.tolist() == [[[True, False, False]]]
    s_all = torch.log(torch.full((1, 1, 10), 0.1))
    s = drop_unusable(s_all.gather(-1, gather_ids), ok)
    # over {3, the rest}: teacher (0.5, 0.5), student (0.1, 0.9): the dropped slots' mass is the tail's
    want = 0.5 * math.log(0.5 / 0.1) + 0.5 * math.log(0.5 / 0.9)
    assert float(top_k_distill_loss(s, t_ok, torch.ones(1, 1), beta=0.0)[0]) == pytest.approx(want, abs=1e-5)
    # k = vocabulary: both tails are rounding noise, floored alike, with no gradient through them
    g = torch.Generator().manual_seed(2)
    s_full = torch.randn(1, 4, 16, generator=g).log_softmax(-1).requires_grad_(True)
    t_full = (torch.randn(1, 4, 16, generator=g) * 4).log_softmax(-1)
    tail = with_tail(s_full)[..., -1]
    assert torch.allclose(tail, torch.full_like(tail, math.log(TAIL_FLOOR)))
    top_k_distill_loss(s_full, t_full, torch.ones(1, 4), beta=0.0)[0].backward()
    # the forward KL's gradient w.r.t. the student's log-probs is -T per token (token-mean over 4 tokens): nothing
    # from the tail's noise
    torch.testing.assert_close(s_full.grad, -t_full.exp() / 4, atol=1e-6, rtol=1e-5)
