"""The rollout-vs-trainer tools, checked against values worked out by hand."""

import math

import pytest
import torch

from rlgraph.ops.algos import policy_loss, rollout_probs_diff, truncated_is_weights

LOG = math.log


def test_probs_diff_by_hand():
    # token 0: p_train 0.5, p_rollout 0.25 -> 0.25; token 1: 0.9 vs 0.8 -> 0.1; token 2 is padding (ignored)
    old = torch.tensor([[LOG(0.5), LOG(0.9), LOG(0.01)]])
    rollout = torch.tensor([[LOG(0.25), LOG(0.8), LOG(0.99)]])
    mask = torch.tensor([[1, 1, 0]])
    d = rollout_probs_diff(old, rollout, mask)
    assert d.mean == pytest.approx((0.25 + 0.1) / 2, rel=1e-5)
    assert d.max == pytest.approx(0.25, rel=1e-5)
    assert rollout_probs_diff(old, rollout, torch.zeros_like(mask)).max == 0.0  # no valid token


def test_truncated_is_weights_by_hand():
    # old - rollout = log 2 -> w = 2, capped at 1.5; log 0.5 -> 0.5; equal -> 1
    old = torch.tensor([[LOG(0.4), LOG(0.1), LOG(0.3)]])
    rollout = torch.tensor([[LOG(0.2), LOG(0.2), LOG(0.3)]])
    w = truncated_is_weights(old, rollout, cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 0.5, 1.0], rel=1e-5)
    assert truncated_is_weights(old, rollout, cap=10.0)[0].tolist() == pytest.approx([2.0, 0.5, 1.0], rel=1e-5)
    with pytest.raises(ValueError, match="cap=0 must be > 0"):
        truncated_is_weights(old, rollout, cap=0)


def test_policy_loss_weights_each_token():
    # ratio 1 (logp = old), A = 1: every token's loss is -1; weights 2 and 0.5 make it -2 and -0.5,
    # the token mean over the 2 valid tokens -1.25; the padding token (weight 7) adds nothing
    old = torch.zeros(1, 3)
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    res = policy_loss(old.clone().requires_grad_(), old, adv, mask, is_weights=torch.tensor([[2.0, 0.5, 7.0]]))
    assert res.pg_losses.tolist()[0][:2] == pytest.approx([-2.0, -0.5])
    assert float(res.loss.detach()) == pytest.approx(-1.25)
    plain = policy_loss(old, old, adv, mask)
    assert float(plain.loss) == pytest.approx(-1.0)


def test_decoupled_weights_by_hand():
    from rlgraph.ops.algos import decoupled_weights

    # behaviour probs 0.5, 0.25, 0.1 for tokens the proximal policy gives 0.5, 0.5, 0.9
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    behav = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    w, keep = decoupled_weights(prox, behav, cap=5.0)
    # w = 1, 2, 9; 9 > 5 leaves the loss (weight 0, mask 0) instead of being truncated to 5
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0]]))
    assert keep.tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match="cap=1.0 must be > 1"):
        decoupled_weights(prox, behav, cap=1.0)


def test_decoupled_loss_equals_weighted_clipped_loss_on_kept_tokens():
    from rlgraph.ops.algos import decoupled_weights, policy_loss

    torch.manual_seed(0)
    logp, prox, behav = (torch.randn(2, 4) * 0.3 - 1.0 for _ in range(3))
    adv, mask = torch.randn(2, 4), torch.ones(2, 4)
    w, keep = decoupled_weights(prox, behav, cap=1.5)
    kept = mask * keep
    got = policy_loss(logp, prox, adv, kept, is_weights=w).loss
    # by hand: token-mean over kept tokens of max(-A r, -A clip(r)) * w, r against the proximal policy
    r = torch.exp(logp - prox)
    per_token = torch.maximum(-adv * r, -adv * torch.clamp(r, 0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token) * w
    torch.testing.assert_close(got, (per_token * kept).sum() / kept.sum())
