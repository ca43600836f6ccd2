"""Masked statistics, loss aggregation, entropy and log-probs, checked against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.ops.algos.core import (
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -7.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0]])  # valid: 1, 2, 3, 4 ; 100 and -7 are padding


def test_masked_mean_over_all_and_along_dim():
    # (1 + 2 + 3 + 4) / 4 = 2.5
    assert masked_mean(X, M).item() == pytest.approx(2.5)
    # rows: (1 + 2 + 3) / 3 = 2 ; 4 / 1 = 4
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([2.0, 4.0]))
    # an all-zero mask gives 0 / (0 + 1e-8) = 0, not nan
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var_is_unbiased():
    # deviations from 2.5: -1.5, -0.5, 0.5, 1.5 ; squares sum to 5 ; mean 5/4 ; Bessel 4/3 -> 5/3
    assert masked_var(X, M).item() == pytest.approx(5 / 3)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(5 / 4)


def test_masked_whiten():
    w = masked_whiten(X, M)
    # (x - 2.5) / sqrt(5/3 + 1e-8): 1 -> -1.5 / 1.29099 = -1.16190
    assert w[0, 0].item() == pytest.approx(-1.5 / math.sqrt(5 / 3), rel=1e-6)
    assert w[1, 0].item() == pytest.approx(1.5 / math.sqrt(5 / 3), rel=1e-6)
    # masked tokens: mean 0, unbiased var 1
    assert masked_mean(w, M).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(w, M).item() == pytest.approx(1.0, rel=1e-6)
    # shift_mean=False only rescales: 1 -> -1.16190 + 2.5
    w_noshift = masked_whiten(X, M, shift_mean=False)
    assert w_noshift[0, 0].item() == pytest.approx(-1.5 / math.sqrt(5 / 3) + 2.5, rel=1e-6)


def test_whitening_ignores_padding_rows():
    padded_x = torch.cat([X, torch.tensor([[1e6, -1e6, 3.0]])])
    padded_m = torch.cat([M, torch.zeros(1, 3, dtype=M.dtype)])
    torch.testing.assert_close(masked_whiten(padded_x, padded_m)[:2], masked_whiten(X, M))


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_var_needs_two_tokens(n_valid):
    mask = torch.tensor([[1] * n_valid + [0] * (3 - n_valid)])
    with pytest.raises(ValueError, match=rf"the mask has {n_valid} valid token\(s\).*at least 2"):
        masked_var(torch.ones(1, 3), mask)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(torch.ones(1, 3), mask)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # the 9s are padding


def test_agg_loss_modes_by_hand():
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert agg_loss(LOSS, M, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: (6 + 4) / 2 = 5
    assert agg_loss(LOSS, M, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: (6/3 + 4/1) / 2 = 3
    assert agg_loss(LOSS, M, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_agg_loss_with_global_normalisers():
    # local sums: tokens 10 ; per-seq sums 6 + 4 = 10 ; per-seq means 2 + 4 = 6
    assert agg_loss(LOSS, M, "token-mean", global_tokens=8).item() == pytest.approx(10 / 8)
    assert agg_loss(LOSS, M, "seq-mean-token-sum", global_seqs=5).item() == pytest.approx(10 / 5)
    assert agg_loss(LOSS, M, "seq-mean-token-mean", global_seqs=4).item() == pytest.approx(6 / 4)
    # each mode reads only its own normaliser
    assert agg_loss(LOSS, M, "token-mean", global_seqs=99).item() == pytest.approx(2.5)
    assert agg_loss(LOSS, M, "seq-mean-token-sum", global_tokens=99).item() == pytest.approx(5.0)


def test_agg_loss_padding_rows_do_not_dilute_seq_means():
    loss = torch.cat([LOSS, torch.full((1, 3), 7.0)])
    mask = torch.cat([M, torch.zeros(1, 3, dtype=M.dtype)])
    for mode, want in [("token-mean", 2.5), ("seq-mean-token-sum", 5.0), ("seq-mean-token-mean", 3.0)]:
        assert agg_loss(loss, mask, mode).item() == pytest.approx(want), mode


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_with_global_normalisers_sum_to_the_full_batch_loss(mode):
    # 7 sequences of different lengths (one a padding row) split into micro-batches of 3, 2, 2,
    # as two dp ranks would hold them; summing the micro-batch losses must give the full loss,
    # and so must summing their gradients.
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 0, 6, 2, 4])
    mask = (torch.arange(6) < lengths.unsqueeze(-1)).long()  # [7, 6]
    loss_mat = torch.randn(7, 6, requires_grad=True)
    full = agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)

    n_tokens = int(mask.sum())  # 21
    n_seqs = int((mask.sum(-1) > 0).sum())  # 6 (the padding row does not count)
    total = torch.zeros(())
    for rows in (slice(0, 3), slice(3, 5), slice(5, 7)):
        total = total + agg_loss(loss_mat[rows], mask[rows], mode, global_tokens=n_tokens, global_seqs=n_seqs)
    (split_grad,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)
    # the naive alternative (average of local means) is wrong for uneven micro-batches
    naive = sum(agg_loss(loss_mat[r], mask[r], mode) for r in (slice(0, 3), slice(3, 5), slice(5, 7))) / 3
    assert not torch.allclose(naive, full)


def test_agg_loss_errors():
    with pytest.raises(ConfigError, match="unknown mode 'seq-sum'; choose one of token-mean, seq-mean-token-sum"):
        agg_loss(LOSS, M, "seq-sum")
    with pytest.raises(ValueError, match=r"'mask' has shape \(2, 2\) but 'loss_mat' has shape \(2, 3\)"):
        agg_loss(LOSS, M[:, :2], "token-mean")
    with pytest.raises(ValueError, match="global_tokens=0 must be > 0"):
        agg_loss(LOSS, M, "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match="global_seqs=-1 must be > 0"):
        agg_loss(LOSS, M, "seq-mean-token-sum", global_seqs=-1)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])  # [1, 2, 4]
    # uniform over 4: H = log 4 = 1.38629 ; one-hot (almost): H = 0
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[math.log(4), 0.0]]))
    # p = (1/2, 1/4, 1/4) from logits log p: H = 0.5 log 2 + 2 * 0.25 log 4 = 1.5 log 2 = 1.03972
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])) + 3.0  # a shift changes nothing
    assert entropy_from_logits(logits).item() == pytest.approx(1.5 * math.log(2), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logprobs_from_logits(dtype):
    # p = (1/2, 1/4, 1/4): log p of ids 0, 2 = log 1/2 = -0.69315, log 1/4 = -1.38629
    logits = (torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]])) + 3.0).to(dtype)
    ids = torch.tensor([[0, 2]])
    got = logprobs_from_logits(logits, ids)
    assert got.shape == (1, 2) and got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.double(), torch.tensor([[-math.log(2), -math.log(4)]], dtype=torch.float64),
                               atol=tol, rtol=tol)


def test_logprobs_match_log_softmax_gather_and_carry_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    want = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    got = logprobs_from_logits(logits, ids)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_want,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g_got, g_want)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1))


def test_logprobs_shape_error():
    with pytest.raises(ValueError, match=r"token_ids has shape \(1, 3\) but logits has shape \(1, 2, 4\)"):
        logprobs_from_logits(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))
