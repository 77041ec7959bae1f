"""estimate(): non-finite rewards, the empty batch, and the returned loss mask / metrics."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import assert_close, lists, spec_fn

NAN = float("nan")


def test_nan_reward_row_is_masked_and_group_baseline_unaffected():
    fn = spec_fn("baseline group_mean")
    r = torch.tensor([1.0, NAN, 0.0, 1.0, 0.5, 0.5, float("inf"), 0.2])
    mask = torch.ones(8, 3)
    est = fn.estimate(r, 4, mask)
    assert lists(est.mask.sum(-1)) == [3, 0, 3, 3, 3, 3, 0, 3]
    # finite rows: r - mean of the finite rewards of the group (2/3 and 0.4)
    a = lists(est.advantages[:, 0])
    assert [a[i] for i in (0, 2, 3, 4, 5, 7)] == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.1, 0.1, -0.2])
    for t in (est.advantages, est.returns, est.rewards):
        assert torch.isfinite(t).all()
    assert est.metrics["nonfinite_rewards"] == 2.0
    assert est.metrics["reward_mean"] == pytest.approx((2 + 1.2) / 6)
    # in the loss the row is gone whatever its (finite) advantage
    b = spec_fn("objective reinforce\naggregation seq_mean_token_sum")
    lp = torch.randn(8, 3, requires_grad=True)
    out = b.loss(lp, lp.detach(), est.advantages, est.mask)
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(g[6]) == 0


def test_nan_reward_in_an_otherwise_constant_group_keeps_it_zero_variance():
    fn = spec_fn("baseline group_mean\nnormalizer group_std\nfilter zero_variance")
    est = fn.estimate(torch.tensor([1.0, NAN, 1.0, 0.0, 1.0, 1.0]), 3, torch.ones(6, 2))
    assert torch.count_nonzero(est.advantages[:3]) == 0
    assert lists(est.mask.sum(-1)) == [0, 0, 0, 2, 2, 2]


def nan_std(xs):
    f = [x for x in xs if math.isfinite(x)]
    mu = sum(f) / len(f)
    return mu, math.sqrt(sum((x - mu) ** 2 for x in f) / (len(f) - 1))


def test_nan_reward_does_not_change_the_group_std_like_trl_nanstd():
    fn = spec_fn("baseline group_mean\nnormalizer group_std(eps=1e-4)")
    r = [1.0, NAN, 0.0, 1.0]
    a = lists(fn.estimate(torch.tensor(r), 4, torch.ones(4, 1)).advantages[:, 0])
    mu, sd = nan_std(r)
    assert [a[0], a[2]] == pytest.approx([(1 - mu) / (sd + 1e-4), (0 - mu) / (sd + 1e-4)], rel=1e-4)


def test_nan_reward_leave_one_out_uses_the_scorable_samples():
    fn = spec_fn("baseline leave_one_out\nobjective reinforce")
    a = lists(fn.estimate(torch.tensor([1.0, NAN, 0.0, 1.0]), 4, torch.ones(4, 1)).advantages[:, 0])
    assert [a[0], a[2], a[3]] == pytest.approx([1 - 0.5, 0 - 1.0, 1 - 0.5])


def test_empty_batch_estimate():
    fn = spec_fn("baseline group_mean\nnormalizer group_std")
    est = fn.estimate(torch.zeros(0), 4, torch.zeros(0, 7))
    assert est.advantages.shape == est.mask.shape == (0, 7)


def test_all_rows_masked_estimate_has_no_nan():
    fn = spec_fn("baseline group_mean\nnormalizer group_std")
    est = fn.estimate(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, torch.zeros(4, 5))
    assert torch.count_nonzero(est.advantages) == 0 and torch.isfinite(est.advantages).all()


def test_advantages_is_estimate_advantages_and_zero_on_padding(eager_algorithm):
    fn = eager_algorithm("grpo")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    r = torch.tensor([1.0, 0.0])
    assert torch.equal(fn.advantages(r, 2, mask), fn.estimate(r, 2, mask).advantages)
    assert_close(fn.advantages(r, 2, mask), [[0.7071061, 0.7071061, 0], [-0.7071061, 0, 0]])


def test_bad_shapes_and_group_sizes_are_refused(eager_algorithm):
    fn = eager_algorithm("grpo")
    with pytest.raises(ValueError, match="groups"):
        fn.estimate(torch.zeros(6), 4, torch.ones(6, 2))
    with pytest.raises(ValueError, match=r"\[B\]"):
        fn.estimate(torch.zeros(6, 1), 3, torch.ones(6, 2))
