"""Advantage estimators against hand-worked values, and padding rows that change nothing."""

from __future__ import annotations

import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.ops import stages
from rlgraph.ops.algos.advantages import ESTIMATORS, compute_advantage


def _whiten_by_hand(values: list[float]) -> torch.Tensor:
    """(x - mean) / unbiased std of a flat list of valid-token values."""
    x = torch.tensor(values, dtype=torch.float32)
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)


def _outcome(scores: list[float], lengths: list[int], T: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with each score on the last valid token, and the response mask."""
    mask = (torch.arange(T) < torch.tensor(lengths).unsqueeze(-1)).long()
    rewards = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, max(n - 1, 0)] = s
    return rewards * mask, mask


def test_estimator_names_match_the_stage_declaration():
    # the declaration offers exactly the estimators compute_advantage knows (one list, in rlgraph.ops.names)
    assert stages.advantage().params["estimator"].choices == ESTIMATORS



def test_gae_by_hand():
    # one sample, 3 valid tokens and one padding token whose value (9) must be ignored
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72, V beyond the last valid token is 0:
    # t=2: delta = 1 + 0.9*0   - 0.7 = 0.3  ; A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03 ; A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04 ; A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    res = compute_advantage("gae", rewards, mask, torch.tensor([0]), values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(res.returns, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))
    want = _whiten_by_hand([0.21712, 0.246, 0.3])
    torch.testing.assert_close(res.advantages[0, :3], want)
    assert res.advantages[0, 3].item() == 0.0


def test_gae_with_gamma_lam_one_is_return_to_go_minus_value():
    # A_t = sum_{k >= t} r_k - V_t = 1 - V_t = 0.5, 0.4, 0.3 ; returns = 1, 1, 1
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.5, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # second row: A = 2 - 1 = 1, 2 - 1.5 = 0.5 ; returns = 2, 2
    res = compute_advantage("gae", rewards, mask, torch.tensor([0, 1]), values=values)
    torch.testing.assert_close(res.returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    want = _whiten_by_hand([0.5, 0.4, 0.3, 1.0, 0.5])
    torch.testing.assert_close(res.advantages[mask.bool()], want)


def test_grpo_by_hand():
    # group 0 scores [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735
    # advantages +-0.5 / (0.57735 + 1e-6) = +-0.86602 ; group 7 has one sample: (2 - 0) / (1 + 1e-6)
    rewards, mask = _outcome([1, 0, 0, 1, 2], [3, 2, 3, 1, 2])
    uid = torch.tensor([0, 0, 0, 0, 7])
    res = compute_advantage("grpo", rewards, mask, uid)
    a = 0.5 / (3 ** -0.5 + 1e-6)
    want = torch.tensor([a, -a, -a, a, 2 / (1 + 1e-6)]).unsqueeze(-1) * mask
    torch.testing.assert_close(res.advantages, want)
    assert a == pytest.approx(0.86602, abs=1e-5)
    assert res.returns is res.advantages


def test_drgrpo_does_not_divide_by_std():
    rewards, mask = _outcome([1, 0, 0, 1, 2], [3, 2, 3, 1, 2])
    uid = torch.tensor([0, 0, 0, 0, 7])
    # s - mean: +-0.5 ; the group of one keeps its score 2
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 2.0]).unsqueeze(-1) * mask
    torch.testing.assert_close(compute_advantage("drgrpo", rewards, mask, uid).advantages, want)
    # "drgrpo" ignores norm_adv_by_std; "grpo" with norm_adv_by_std=False is the same thing
    torch.testing.assert_close(compute_advantage("drgrpo", rewards, mask, uid, norm_adv_by_std=True).advantages, want)
    torch.testing.assert_close(compute_advantage("grpo", rewards, mask, uid, norm_adv_by_std=False).advantages, want)


def test_rloo_by_hand():
    # group 0 (n=4) scores [4, 0, 2, 2], mean 2: A_i = s_i - mean of the other three
    #   4 - (0+2+2)/3 = 8/3 ; 0 - 8/3 = -8/3 ; 2 - 6/3 = 0 ; 0
    #   = s*4/3 - 2*4/3: 16/3 - 8/3 = 8/3 (same)
    # group 5 has one sample: no others to compare with, baseline 0 (verl's rule): its score 9
    rewards, mask = _outcome([4, 0, 2, 2, 9], [3, 1, 2, 3, 3])
    uid = torch.tensor([0, 0, 0, 0, 5])
    res = compute_advantage("rloo", rewards, mask, uid)
    want = torch.tensor([8 / 3, -8 / 3, 0.0, 0.0, 9.0]).unsqueeze(-1) * mask
    torch.testing.assert_close(res.advantages, want)


def test_reinforce_plus_plus_by_hand():
    # gamma = 0.5 ; row 0 r = [1, 0, 2]: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    #               row 1 r = [0, 3, pad 7]: G1 = 3, G0 = 1.5 (the padding reward is ignored)
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    res = compute_advantage("reinforce_plus_plus", rewards, mask, torch.tensor([0, 1]), gamma=0.5)
    torch.testing.assert_close(res.returns, torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    # whitened over the 5 valid tokens (mean 9/5 = 1.8)
    torch.testing.assert_close(res.advantages[mask.bool()], _whiten_by_hand([1.5, 1.0, 2.0, 1.5, 3.0]))
    assert res.advantages[1, 2].item() == 0.0


def test_reinforce_plus_plus_baseline_by_hand():
    # scores [3, 1 | 5], uid [0, 0 | 1]: group 0 mean 2 -> +1, -1 ; group of one: mean 0 -> 5
    # broadcast over lengths [2, 1, 2]: tokens 1, 1, -1, 5, 5 (mean 11/5 = 2.2), then whitened
    rewards, mask = _outcome([3, 1, 5], [2, 1, 2])
    res = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, torch.tensor([0, 0, 1]))
    torch.testing.assert_close(res.advantages[mask.bool()], _whiten_by_hand([1, 1, -1, 5, 5]))
    assert (res.advantages[~mask.bool()] == 0).all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_padding_rows_and_padding_tokens_change_nothing(estimator):
    torch.manual_seed(0)
    lengths = torch.tensor([4, 2, 3, 1])
    mask = (torch.arange(5) < lengths.unsqueeze(-1)).long()  # [4, 5]
    rewards = torch.randn(4, 5) * mask
    values = torch.randn(4, 5) * mask
    uid = torch.tensor([3, 3, 8, 8])
    kw = dict(values=None, gamma=0.9, lam=0.95)
    # distill: the student's log-probs are `values`, the teacher's `values / 2` (junk on padding follows them),
    # mixed with GRPO's advantage at weight 0.5
    distill = (lambda v: dict(student_log_probs=v, teacher_log_probs=v / 2, distill_task_weight=0.5)) \
        if estimator == "distill" else (lambda v: {})
    base = compute_advantage(estimator, rewards, mask, uid, **{**kw, "values": values}, **distill(values))

    # garbage on the padding tokens of the real rows, and two padding rows with their own uids
    junk = torch.randn(6, 5) * 100
    pad_mask = torch.cat([mask, torch.zeros(2, 5, dtype=mask.dtype)])
    pad_rewards = torch.where(pad_mask.bool(), torch.cat([rewards, rewards[:2]]), junk)
    pad_values = torch.where(pad_mask.bool(), torch.cat([values, values[:2]]), junk.flip(0))
    pad_uid = torch.tensor([3, 3, 8, 8, 100, 101])
    padded = compute_advantage(estimator, pad_rewards, pad_mask, pad_uid, **{**kw, "values": pad_values},
                               **distill(pad_values))

    torch.testing.assert_close(padded.advantages[:4], base.advantages)
    torch.testing.assert_close(padded.returns[:4], base.returns)
    assert (padded.advantages[4:] == 0).all() and (padded.advantages[~pad_mask.bool()] == 0).all()


def test_compute_advantage_does_not_track_gradients():
    rewards = torch.ones(2, 3, requires_grad=True)
    res = compute_advantage("grpo", rewards, torch.ones(2, 3), torch.tensor([0, 0]))
    assert not res.advantages.requires_grad


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ConfigError, match="unknown advantage estimator 'ppo'; choose one of gae, grpo, drgrpo, rloo"):
        compute_advantage("ppo", torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0]))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="estimator 'gae' needs values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0]))


def test_shape_problems_are_reported_together():
    with pytest.raises(ValueError, match="^grpo_advantages: ") as err:
        compute_advantage("grpo", torch.zeros(2, 3), torch.ones(2, 4), torch.tensor([0.0, 1.0, 2.0]))
    msg = str(err.value)
    assert r"response_mask has shape (2, 4) but token_level_rewards has (2, 3)" in msg
    assert "uid has shape (3,); it must be [b] = (2,)" in msg
    assert "uid has dtype torch.float32; pass an integer (int64) prompt id" in msg


def test_shape_errors_for_values_and_rank():
    with pytest.raises(ValueError, match=r"values has shape \(2, 2\) but token_level_rewards has \(2, 3\)"):
        compute_advantage("gae", torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0, 1]), values=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"token_level_rewards must be \[b, T\], got shape \(3,\)"):
        compute_advantage("reinforce_plus_plus", torch.zeros(3), torch.ones(3), torch.tensor([0]))


@pytest.mark.parametrize("estimator,want", [
    ("grpo", 3.0 / (1 + 1e-6)),  # (s - 0) / (1 + eps)
    ("drgrpo", 3.0),  # s - 0
    ("rloo", 3.0),  # s - 0: no others, baseline 0
])
def test_a_group_of_one_passes_its_raw_score_through_in_every_group_estimator(estimator, want):
    """One rule, verl's, for every group estimator: a group of one has baseline 0 (and std 1)."""
    rewards, mask = _outcome([3, 1, 5], [2, 1, 2])
    uid = torch.tensor([4, 0, 0])  # row 0 is alone in its group
    res = compute_advantage(estimator, rewards, mask, uid)
    torch.testing.assert_close(res.advantages[0], torch.tensor([want, want, 0.0]) * mask[0])
    # reinforce_plus_plus_baseline (whitened afterwards): the alone row enters as its raw score 3
    base = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, uid)
    # scores [3 | 1, 5]: 3 - 0 = 3 ; 1 - 3 = -2 ; 5 - 3 = 2 -> tokens 3, 3, -2, 2, 2, whitened
    torch.testing.assert_close(base.advantages[mask.bool()], _whiten_by_hand([3, 3, -2, 2, 2]))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_accept_an_empty_batch(estimator):
    res = compute_advantage(estimator, torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert res.advantages.shape == (0, 3)


def test_distill_by_hand():
    # two responses of 3 and 2 tokens; student and teacher log-probs of the sampled tokens:
    #   row 0: student [-1.0, -0.5, -2.0], teacher [-0.5, -0.5, -3.0] -> A = teacher - student = [0.5, 0, -1.0]
    #   row 1: student [-0.2, -4.0],       teacher [-1.2, -1.0]       -> A = [-1.0, 3.0], and 0 past the response
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    student = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -4.0, -9.0]])
    teacher = torch.tensor([[-0.5, -0.5, -3.0], [-1.2, -1.0, -7.0]])
    rewards = torch.zeros(2, 3)
    res = compute_advantage("distill", rewards, mask, torch.tensor([0, 0]), student_log_probs=student,
                            teacher_log_probs=teacher)
    torch.testing.assert_close(res.advantages, torch.tensor([[0.5, 0.0, -1.0], [-1.0, 3.0, 0.0]]))
    assert res.returns is res.advantages
    # mixed with the task reward: one group, scores 1 and 0 on the last tokens -> GRPO +-(0.5 / std) on every token,
    # std of [1, 0] (unbiased) = 0.70711: +-0.70711, times the weight 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mixed = compute_advantage("distill", rewards, mask, torch.tensor([0, 0]), student_log_probs=student,
                              teacher_log_probs=teacher, distill_task_weight=0.5)
    g = 0.5 / (2 ** -0.5 + 1e-6) * 0.5
    torch.testing.assert_close(mixed.advantages, torch.tensor([[0.5 + g, g, -1.0 + g], [-1.0 - g, 3.0 - g, 0.0]]))
    # the reverse-KL term weighted (0: the teacher's signal is the update's dense loss, only the task's is left)
    task_only = compute_advantage("distill", rewards, mask, torch.tensor([0, 0]), student_log_probs=student,
                                  teacher_log_probs=teacher, distill_task_weight=0.5, distill_kl_weight=0.0)
    torch.testing.assert_close(task_only.advantages, torch.tensor([[g, g, g], [-g, -g, 0.0]]))
    half = compute_advantage("distill", rewards * 0, mask, torch.tensor([0, 0]), student_log_probs=student,
                             teacher_log_probs=teacher, distill_kl_weight=0.5)
    torch.testing.assert_close(half.advantages, torch.tensor([[0.25, 0.0, -0.5], [-0.5, 1.5, 0.0]]))
    with pytest.raises(ValueError, match="needs student_log_probs"):
        compute_advantage("distill", rewards, mask, torch.tensor([0, 0]))


@pytest.mark.parametrize("estimator, use_kl", [("grpo", False), ("rloo", False), ("grpo", True), ("drgrpo", True)])
def test_a_vectorised_advantage_call_gives_what_one_call_per_group_gives(estimator, use_kl):
    """The advantage op is vectorised: one body call on every ready group gives each group's
    advantages bit for bit, one metrics record per group, and the same KL-controller history as
    a call per group (the adaptive controller's update reads one KL per group)."""
    from rlgraph.ops.algos.advantage_op import AdvantageWorker
    from rlgraph.runtime.invoke import OpContext

    if estimator not in ESTIMATORS:
        pytest.skip(f"no estimator {estimator!r}")
    n, groups, T = 4, 5, 6
    g = torch.Generator().manual_seed(0)
    b = n * groups
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).long()
    scores = torch.zeros(b, T)
    scores[torch.arange(b), lengths - 1] = torch.rand(b, generator=g)
    old, ref = -torch.rand(b, T, generator=g), -torch.rand(b, T, generator=g)
    uid = torch.arange(groups).repeat_interleave(n)
    pad = torch.zeros(b, dtype=torch.bool)
    pad[-n:] = True  # the last group is padding
    kw = dict(estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std=True, use_kl_in_reward=use_kl,
              kl_penalty="kl", kl_coef=0.01, kl_ctrl="adaptive", kl_target=0.1, kl_horizon=100)

    def ctx(step, chunks):
        return OpContext(op="advantage", group="g", rank=0, dp=1, step=step, chunk=0, seed=0, rows=(), is_padding=(),
                         chunks=chunks)

    whole, per_group = AdvantageWorker(), AdvantageWorker()
    whole.setup(None)
    per_group.setup(None)
    for step in (0, 1):  # step 1's controller adapts to step 0's per-group KLs
        one = whole.compute_advantage(scores, mask, uid, pad, old_log_probs=old, ref_log_prob=ref,
                                      ctx=ctx(step, (n,) * groups), **kw)
        calls = [per_group.compute_advantage(scores[i:i + n], mask[i:i + n], uid[i:i + n], pad[i:i + n],
                                             old_log_probs=old[i:i + n], ref_log_prob=ref[i:i + n],
                                             ctx=ctx(step, (n,)), **kw) for i in range(0, b, n)]
        for col in ("advantages", "returns", "token_level_rewards"):
            assert torch.equal(one[col], torch.cat([c[col] for c in calls])), col
        assert len(one["advantage_metrics"]) == groups
        for got, call in zip(one["advantage_metrics"], calls):
            want = call["advantage_metrics"]  # a call of one chunk: one record, not a list
            assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert whole.state_dict() == per_group.state_dict()
    if use_kl:
        assert "kl" in one["advantage_metrics"][0] and len(whole.step_kl) == groups


def test_a_whole_batch_estimator_reports_one_metrics_record():
    """GAE is not vectorised (one chunk per call): its metrics are one record, which the step's
    metrics flatten (a list would be dropped)."""
    from rlgraph.ops.algos.advantage_op import AdvantageWorker
    from rlgraph.runtime.invoke import OpContext
    from rlgraph.runtime.metrics import flatten_metrics

    assert not stages.advantage("gae").vectorised and stages.advantage("grpo").vectorised
    assert not stages.advantage("grpo", granularity="batch").vectorised  # an override of the granularity
    w = AdvantageWorker()
    w.setup(None)
    b, T = 4, 3
    out = w.compute_advantage(torch.rand(b, T), torch.ones(b, T, dtype=torch.long), torch.arange(b),
                              torch.zeros(b, dtype=torch.bool), values=torch.rand(b, T), estimator="gae", gamma=1.0,
                              lam=1.0, norm_adv_by_std=True, use_kl_in_reward=False, kl_penalty="kl", kl_coef=0.0,
                              kl_ctrl="fixed", kl_target=0.1, kl_horizon=100,
                              ctx=OpContext(op="advantage", group="g", rank=0, dp=1, step=0, chunk=0, seed=0, rows=(),
                                            is_padding=(), chunks=(b,)))
    flat = flatten_metrics("advantage", {"advantage_metrics": out["advantage_metrics"]})
    assert {"advantage/advantage_metrics/advantages/mean", "advantage/advantage_metrics/returns/mean"} <= set(flat)


def test_the_advantage_worker_keeps_state_only_with_the_kl_term_in_the_reward():
    # without the KL controller a dead advantage worker loses nothing: its group is restarted and its
    # calls run again, instead of restoring every worker from a checkpoint (GroupWorker.has_instance_state)
    from rlgraph.ops.algos.advantage_op import AdvantageWorker

    plain, with_kl = AdvantageWorker(), AdvantageWorker()
    plain.setup(None)
    with_kl.setup({"algorithm": {"use_kl_in_reward": True}})
    assert not plain.keeps_state() and with_kl.keeps_state()
