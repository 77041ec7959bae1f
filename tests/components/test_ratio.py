"""ratio slot: verl's token ratio (log clamp +-20) and GSPO's sequence ratio (value and gradient)."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import assert_close, lists, random_batch, ref_token_weights, spec_fn
from rldsl.components import ratio as ra


def test_token_log_ratio_clamped_like_verl():
    logp = torch.tensor([5.0, -25.0, 0.3, -1.0], requires_grad=True)
    old = torch.tensor([-20.0, 0.0, 0.0, -1.0])
    lr = ra.token(logp, old, torch.ones(4), torch.ones(4), clamp=20.0)
    assert lists(lr) == pytest.approx([20.0, -20.0, 0.3, 0.0])
    (g,) = torch.autograd.grad(lr.sum(), logp)
    assert lists(g) == [0.0, 0.0, 1.0, 1.0]  # no gradient through a clamped ratio
    # TRL does not clamp: a large clamp reproduces it
    assert ra.token(logp, old, torch.ones(4), torch.ones(4), clamp=1e4)[0].item() == pytest.approx(25.0)


def ref_gspo(L, O, M, A, lo, hi):
    """verl compute_policy_loss_gspo per token: (loss, d loss / d logp) lists.
    log s_i = clamp(mean_t m log rho, max=10) (token values); d log s_it / d logp_it = 1."""
    loss, dl = [], []
    for i in range(len(M)):
        n = max(sum(M[i]), 1)
        mean = sum((L[i][t] - O[i][t]) * M[i][t] for t in range(len(M[i])) if M[i][t] > 0) / n
        s = math.exp(min(mean, 10.0))
        grad_flows = mean < 10.0
        rl, rd = [], []
        for t in range(len(M[i])):
            a = A[i][t]
            pg1, pg2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            if pg1 >= pg2 or 1 - lo < s < 1 + hi:
                rl.append(pg1)
                rd.append(-a * s * grad_flows)
            else:
                rl.append(pg2)
                rd.append(0.0)
        loss.append(rl)
        dl.append(rd)
    return loss, dl


def test_sequence_ratio_hand_numbers():
    # masked mean of log rho over [0.2, -0.4] = -0.1 -> s = e^-0.1 on every token of the row
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.2, -1.6, 5.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    s = ra.sequence(logp, old, mask, torch.ones_like(mask), clamp=10.0).exp()
    assert lists(s[0]) == pytest.approx([math.exp(-0.1)] * 3)
    assert lists(s[1]) == [1.0, 1.0, 1.0]  # a fully masked row has ratio 1, not NaN


def test_sequence_ratio_clamped_above_at_10():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-12.0, -12.0]])
    lr = ra.sequence(logp, old, torch.ones(1, 2), torch.ones(1, 2), clamp=10.0)
    assert lists(lr) == [[10.0, 10.0]]
    (g,) = torch.autograd.grad(lr.sum(), logp)
    assert torch.count_nonzero(g) == 0


def test_sequence_ratio_ignores_infinite_padding():
    inf = float("inf")
    logp = torch.tensor([[-1.0, -2.0, inf], [-1.0, -1.0, -inf]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, -inf], [-1.0, -1.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    lr = ra.sequence(logp, old, mask, torch.ones_like(mask), clamp=10.0)
    assert_close(lr[:, :2], [[0.05, 0.05], [0.1, 0.1]])
    (g,) = torch.autograd.grad((lr * mask).sum(), logp)
    assert torch.isfinite(g).all() and lists(g) == [[1, 1, 0], [1, 1, 0]]


@pytest.mark.parametrize("agg,mode", [("token_mean", "token_mean"),
                                      ("seq_mean_token_mean", "seq_mean_token_mean")])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_loss_value_and_gradient_match_verl(agg, mode, seed):
    fn = spec_fn(f"ratio sequence\ntrust_region clip(low=0.0003, high=0.0004)\naggregation {agg}")
    b = random_batch(6, 8, seed, empty_rows=(2,))
    b["old"] = b["logp"] + 0.05 * torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"])
    (g,) = torch.autograd.grad(out.loss, lp)
    M = lists(b["mask"])
    loss, dl = ref_gspo(lists(b["logp"]), lists(b["old"]), M, lists(b["adv"]), 0.0003, 0.0004)
    w = ref_token_weights(M, mode)
    assert out.loss.item() == pytest.approx(
        sum(loss[i][t] * w[i][t] for i in range(6) for t in range(8)), rel=1e-5)
    assert_close(g, [[dl[i][t] * w[i][t] for t in range(8)] for i in range(6)], rtol=1e-4, atol=1e-7)
    # GSPO's clip range is tiny: some sequences are clipped (zero gradient), some are not
    rows = (g.abs().sum(-1) > 0)
    assert 0 < int(rows.sum()) < 5
