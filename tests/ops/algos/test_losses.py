"""PPO policy and value losses against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlgraph.ops.algos.losses import gspo_policy_loss, policy_loss, value_loss

# five tokens, eps = 0.2, clip_ratio_c = 3:
#   A =  1, ratio e   : -A*r = -e,  -A*clip = -1.2 -> max = -1.2   (clipped)
#   A = -1, ratio 5   :  5,          1.2         -> max = 5, dual min(5, 3) = 3  (dual clipped)
#   A = -1, ratio 0.5 :  0.5,        0.8         -> max = 0.8       (clipped)
#   A =  1, ratio 1   : -1,         -1           -> -1
#   A =  2, ratio 0.5 : -1,         -1.6         -> max = -1        (pessimistic: not clipped)
ADV = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0]])
LOG_RATIO = torch.tensor([[1.0, math.log(5), math.log(0.5), 0.0, math.log(0.5)]])
OLD = torch.tensor([[-2.0, -1.0, -3.0, -0.5, -1.5]])
MASK = torch.ones(1, 5)


def test_policy_loss_by_hand():
    logp = (OLD + LOG_RATIO).requires_grad_()
    res = policy_loss(logp, OLD, ADV, MASK)
    torch.testing.assert_close(res.pg_losses.detach(), torch.tensor([[-1.2, 3.0, 0.8, -1.0, -1.0]]))
    # token-mean: (-1.2 + 3 + 0.8 - 1 - 1) / 5 = 0.6 / 5 = 0.12
    assert res.loss.item() == pytest.approx(0.12, rel=1e-6)
    # ratio clip active on tokens 0 and 2: 2/5 ; dual clip on token 1: 1/5
    assert res.clipfrac.item() == pytest.approx(0.4)
    assert res.clipfrac_lower.item() == pytest.approx(0.2)
    # approx_kl = mean(-log r) = -(1 + ln 5 + 2 ln 0.5 + 0) / 5 = -0.2446288
    assert res.approx_kl.item() == pytest.approx(-(1 + math.log(5) + 2 * math.log(0.5)) / 5, rel=1e-6)
    # gradient: 0 where clipped; d(-A*r)/dlogp = -A*r, divided by 5 tokens:
    #   token 3: -1 * 1 / 5 = -0.2 ; token 4: -2 * 0.5 / 5 = -0.2
    (grad,) = torch.autograd.grad(res.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -0.2, -0.2]]))


def test_dual_clip_bound_is_configurable():
    # A = -1, ratio 5: min(5, clip_ratio_c) ; with clip_ratio_c = 10 the ratio loss 5 stands
    res = policy_loss(OLD + LOG_RATIO, OLD, ADV, MASK, clip_ratio_c=10.0)
    assert res.pg_losses[0, 1].item() == pytest.approx(5.0)
    assert res.clipfrac_lower.item() == 0.0


def test_clip_higher():
    # eps_low = 0.2, eps_high = 0.28: A = 1, ratio e -> -1.28 ; A = -1, ratio 0.5 -> 0.8 (low bound)
    res = policy_loss(OLD + LOG_RATIO, OLD, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert res.pg_losses[0, 0].item() == pytest.approx(-1.28)
    assert res.pg_losses[0, 2].item() == pytest.approx(0.8)


def test_log_ratio_is_clamped_to_twenty():
    # logp - old = 50 is clamped to 20: ratio e^20 stays finite ; A = -1 -> dual clip 3 ; A = 1 -> -1.2
    logp = torch.tensor([[50.0, 50.0]], requires_grad=True)
    res = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(res.pg_losses.detach(), torch.tensor([[3.0, -1.2]]))
    assert res.approx_kl.item() == pytest.approx(-20.0)
    (grad,) = torch.autograd.grad(res.loss, logp)
    assert torch.isfinite(grad).all()


def test_policy_loss_ignores_padding_and_aggregates_by_mode():
    # tokens 3 and 4 are padding: token-mean over tokens 0-2 = (-1.2 + 3 + 0.8) / 3 = 2.6 / 3
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    res = policy_loss(OLD + LOG_RATIO, OLD, ADV, mask)
    assert res.loss.item() == pytest.approx(2.6 / 3, rel=1e-6)
    assert res.clipfrac.item() == pytest.approx(2 / 3)
    # seq-mean-token-sum with 4 sequences in the whole mini-batch: 2.6 / 4
    res = policy_loss(OLD + LOG_RATIO, OLD, ADV, mask, agg_mode="seq-mean-token-sum", global_seqs=4)
    assert res.loss.item() == pytest.approx(2.6 / 4, rel=1e-6)


def test_policy_loss_errors():
    with pytest.raises(ValueError, match=r"clip_ratio_low=1.0 must be in \[0, 1\); clip_ratio_high=-0.1 must be >= 0; "
                                         r"clip_ratio_c=0.5 must be >= 1"):
        policy_loss(OLD, OLD, ADV, MASK, clip_ratio_low=1.0, clip_ratio_high=-0.1, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match=r"policy_loss: 'advantages' has shape \(1, 4\) but 'logp' has shape"):
        policy_loss(OLD, OLD, ADV[:, :4], MASK)


def test_value_loss_by_hand():
    # eps = 0.2:
    #   v 2,   v_old 1, R 3:   clip 1.2 ; (2-3)^2 = 1,       (1.2-3)^2 = 3.24 -> 0.5 * 3.24 = 1.62  (clipped)
    #   v 1.1, v_old 1, R 1:   clip 1.1 ; 0.01, 0.01                          -> 0.005
    #   v 0.5, v_old 1, R 0:   clip 0.8 ; 0.25, 0.64                          -> 0.32  (clipped)
    #   padding token (v 9)                                                   -> ignored
    values = torch.tensor([[2.0, 1.1, 0.5, 9.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[3.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    res = value_loss(values, old, returns, mask, cliprange_value=0.2)
    torch.testing.assert_close(res.vf_losses[0, :3].detach(), torch.tensor([1.62, 0.005, 0.32]))
    # token-mean: (1.62 + 0.005 + 0.32) / 3 = 0.648333
    assert res.loss.item() == pytest.approx(1.945 / 3, rel=1e-6)
    assert res.vf_clipfrac.item() == pytest.approx(2 / 3)
    # the clipped branch holds v fixed: gradient only on token 1: (v - R) / 3 = 0.1 / 3
    (grad,) = torch.autograd.grad(res.loss, values)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.1 / 3, 0.0, 0.0]]))


def test_value_loss_errors():
    v = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cliprange_value=-0.5 must be >= 0"):
        value_loss(v, v, v, v, cliprange_value=-0.5)
    with pytest.raises(ValueError, match=r"'returns' has shape \(1, 3\) but 'values' has shape \(1, 2\)"):
        value_loss(v, v, torch.zeros(1, 3), v)


def test_gspo_by_hand():
    """GSPO: one ratio per sequence, the geometric mean of its token ratios, clipped per sequence.

    eps_low = 0.2, eps_high = 0.04.
      seq 0, 2 valid tokens, log r = [0.2, -0.1] (a padding token with log r = 5 is ignored):
        s = exp(0.05) = 1.05127 > 1.04; A = 1: max(-1.05127, -1.04) = -1.04 (clipped), both tokens
      seq 1, 3 tokens, log r = [-0.3, 0, 0]: s = exp(-0.1) = 0.904837, inside; A = -2: 1.809675
      seq-mean-token-mean: (-1.04 + 1.809675) / 2 = 0.3848375
      clipfrac: the 2 clipped tokens of 5; approx_kl = mean(-log r) = (-0.2 + 0.1 + 0.3) / 5 = 0.04
      gradient: seq 0 clipped -> 0; seq 1 token t: d/dlogp_t of (1/2)(1/3) sum_t 2 s = s / 3 = 0.301612
    """
    old = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.5, -2.5]])
    logp = (old + torch.tensor([[0.2, -0.1, 5.0], [-0.3, 0.0, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    res = gspo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.04)
    assert float(res.loss.detach()) == pytest.approx(0.3848375, abs=1e-6)
    assert float(res.clipfrac) == pytest.approx(0.4) and float(res.approx_kl) == pytest.approx(0.04, abs=1e-6)
    torch.testing.assert_close(res.pg_losses[1], torch.full((3,), 2 * math.exp(-0.1)))
    res.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [math.exp(-0.1) / 3] * 3]))


def test_gspo_equals_ppo_when_every_token_has_the_sequence_ratio():
    """If each token's ratio already equals its sequence's geometric mean and nothing clips, GSPO's
    loss is vanilla PPO's under the same seq-mean-token-mean aggregation."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    logp = old + torch.tensor([[0.01, 0.01], [-0.02, -0.02]])
    mask = torch.ones(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    gspo = gspo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    ppo = policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, agg_mode="seq-mean-token-mean")
    assert float(gspo.loss) == pytest.approx(float(ppo.loss), abs=1e-6)
