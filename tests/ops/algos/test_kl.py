"""KL estimators, the in-reward penalty, the actor's KL loss and the KL controllers, by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.ops.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
)

# d = logp - ref_logp = 0.5 and -0.5
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.5]])


@pytest.mark.parametrize(
    "kinds, want",
    [
        # k1 = d
        (("kl", "k1"), [0.5, -0.5]),
        # |d|
        (("abs",), [0.5, 0.5]),
        # k2 = d^2 / 2 = 0.125
        (("mse", "k2"), [0.125, 0.125]),
        # k3 = exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.1065307 ; exp(0.5) - 1.5 = 0.1487213
        (("low_var_kl", "k3"), [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
    ],
)
def test_kl_estimators_at_half(kinds, want):
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([want]), msg=kind)


def test_k3_is_clamped_to_ten_with_finite_gradients():
    # d = -30: exp(30) - 31 ~ 1e13 -> 10 ; d = 30: exp(-30) + 29 = 29 -> 10 ; d = 0 -> 0
    logp = torch.tensor([[-30.0, 30.0, 0.0, -200.0]], requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(1, 4), "k3")
    torch.testing.assert_close(kl.detach(), torch.tensor([[10.0, 10.0, 0.0, 10.0]]))
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    # clamped positions pass no gradient; at d = 0 the gradient 1 - exp(-d) is 0 too
    torch.testing.assert_close(grad, torch.zeros(1, 4))


def test_kl_penalty_errors():
    with pytest.raises(ConfigError, match="unknown kind 'k4'; choose one of kl, k1, abs, mse, k2, low_var_kl, k3"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match=r"'ref_logp' has shape \(1, 3\) but 'logp' has shape \(1, 2\)"):
        kl_penalty(LOGP, torch.zeros(1, 3), "kl")


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    # d = [[0.5, -0.5, 1.0], [0.2, 0.4, pad 9]]
    old = torch.tensor([[0.5, -0.5, 1.0], [0.2, 0.4, 9.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    res = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kind="kl")
    # r = s - 0.1 * d on valid tokens, 0 on padding
    torch.testing.assert_close(res.token_level_rewards, torch.tensor([[-0.05, 0.05, 0.9], [-0.02, 1.96, 0.0]]))
    # per-sample KL: (0.5 - 0.5 + 1) / 3 = 1/3 ; (0.2 + 0.4) / 2 = 0.3 ; mean = 0.316667
    assert res.current_kl == pytest.approx((1 / 3 + 0.3) / 2, rel=1e-6)

    # a padding row (all-zero mask) neither gets a reward nor pulls current_kl towards 0
    pad = apply_kl_penalty(
        torch.cat([scores, torch.ones(1, 3)]), torch.cat([old, torch.ones(1, 3)]),
        torch.zeros(3, 3), torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)]), kl_coef=0.1, kind="kl",
    )
    torch.testing.assert_close(pad.token_level_rewards[:2], res.token_level_rewards)
    assert (pad.token_level_rewards[2] == 0).all()
    assert pad.current_kl == pytest.approx(res.current_kl)


def test_apply_kl_penalty_all_padding_and_shape_error():
    res = apply_kl_penalty(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), 0.1, "k2")
    assert res.current_kl == 0.0
    with pytest.raises(ValueError, match=r"'response_mask' has shape \(1, 3\) but 'token_level_scores'"):
        apply_kl_penalty(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2), torch.ones(1, 3), 0.1, "kl")


def test_kl_loss_by_hand():
    # k3 at d = 0.5, -0.5: token-mean (0.1065307 + 0.1487213) / 2 = 0.127626
    want = (math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5) / 2
    assert kl_loss(LOGP, REF, torch.ones(1, 2)).item() == pytest.approx(want, rel=1e-6)
    # k1 over the first token only, seq-mean-token-sum: 0.5 / 1 sequence
    mask = torch.tensor([[1, 0]])
    assert kl_loss(LOGP, REF, mask, kind="k1", agg_mode="seq-mean-token-sum").item() == pytest.approx(0.5)
    # with a global token count of 4: 0.5 / 4
    assert kl_loss(LOGP, REF, mask, kind="k1", global_tokens=4).item() == pytest.approx(0.125)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05
    assert json.loads(json.dumps(ctrl.state_dict())) == {"type": "FixedKLController", "value": 0.05}


def test_adaptive_controller_one_update_by_hand():
    # KL 9 vs target 6: 9/6 - 1 = 0.5, clipped to 0.2 ; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.100512)
    # KL 3 vs target 6: -0.5, clipped to -0.2 ; mult = 0.99488
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=3.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.099488)
    # KL 0.11 vs target 0.1: 0.1, inside the clip ; mult = 1 + 0.1 * 100 / 1000 = 1.01 ; 0.2 -> 0.202
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    ctrl.update(current_kl=0.11, n_steps=100)
    assert ctrl.value == pytest.approx(0.202)


def test_adaptive_controller_state_round_trips_through_json():
    ctrl = AdaptiveKLController(0.1, 6.0, 10000)
    ctrl.update(9.0, 256)
    state = json.loads(json.dumps(ctrl.state_dict()))
    resumed = AdaptiveKLController(0.1, 6.0, 10000)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value
    resumed.update(9.0, 256)
    assert resumed.value == pytest.approx(0.100512 * 1.00512)


def test_controller_errors():
    with pytest.raises(ValueError, match="init_kl_coef=-1 must be >= 0; target_kl=0 must be > 0; horizon=0 must"):
        AdaptiveKLController(-1, 0, 0)
    with pytest.raises(ValueError, match="kl_coef=-0.1 must be >= 0"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="state is from 'FixedKLController', not 'AdaptiveKLController'"):
        AdaptiveKLController(0.1, 6.0, 100).load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="state is from 'list', not 'FixedKLController'"):
        FixedKLController(0.1).load_state_dict([0.1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'value' must be a number, got None"):
        FixedKLController(0.1).load_state_dict({"type": "FixedKLController"})
