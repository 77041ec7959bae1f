"""Hypothesis properties of the peers' components: what each formula promises, for any input
(any seed): soft gate and PPO agree on-policy, the Gamma weight is 1 at rho = 1 and peaks at
k/lambda, straight-through KL has the base value and k2's gradient, token_sum is exact over
micro-batches, the new baselines satisfy their definitions, DRO's gradient at A = 0 is the
penalty's, and the product ratio's gradient is that of one sequence-level term per row."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from component_refs import spec_fn
from rldsl.components import baseline as bl
from rldsl.components import kl
from rldsl.components import trust_region as tr
from rldsl.ops import AdvantageBatch

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
seeds = st.integers(0, 2**31 - 1)
F64 = torch.float64


def batch(seed: int, B: int = 6, T: int = 7, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logp = (0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=F64)).log()
    old = (logp + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = (logp + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(F64)
    a = torch.randn(B, 1, generator=g, dtype=F64)
    return logp, old, ref, mask, a * mask


def grad(fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    out = fn.loss(lp, old, adv, mask, **kw)
    return out.loss, torch.autograd.grad(out.loss, lp)[0]


_FNS: dict[str, object] = {}


def fn(spec: str):
    if spec not in _FNS:
        _FNS[spec] = spec_fn(spec)
    return _FNS[spec]


# ---------------------------------------------------------------- soft gate (SAPO)


@SETTINGS
@given(seed=seeds, tau_pos=st.floats(0.05, 20), tau_neg=st.floats(0.05, 20))
def test_soft_gate_equals_ppo_on_policy(seed, tau_pos, tau_neg):
    """At rho = 1 the gate's slope is 1: SAPO's gradient equals PPO's (one update per rollout)."""
    logp, _, _, mask, adv = batch(seed)
    sapo = fn(f"trust_region soft_gate(tau_pos={tau_pos!r}, tau_neg={tau_neg!r})")
    _, g_sapo = grad(sapo, logp, logp, adv, mask)
    _, g_ppo = grad(fn("trust_region clip"), logp, logp, adv, mask)
    torch.testing.assert_close(g_sapo, g_ppo, rtol=1e-12, atol=1e-15)


@SETTINGS
@given(rho=st.floats(0, 1e6), tau=st.floats(0.05, 20), a=st.sampled_from([-1.0, 0.0, 1.0]))
def test_soft_gate_is_bounded_and_increasing(rho, tau, a):
    r = torch.tensor([rho, rho + 1e-3], dtype=F64)
    w = tr.soft_gate(r, torch.full((2,), a, dtype=F64), r, r, tau_pos=tau, tau_neg=tau)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w <= 4 / tau + 1e-12).all()
    assert w[1] >= w[0]


# ---------------------------------------------------------------- Gamma weight (VESPO)


@SETTINGS
@given(k=st.floats(0, 10), lam=st.floats(1e-4, 10), a=st.sampled_from([-0.5, 0.0, 2.0]))
def test_gamma_weight_is_one_at_rho_one_and_peaks_at_k_over_lambda(k, lam, a):
    one = torch.ones(1, dtype=F64)
    adv = torch.full((1,), a, dtype=F64)
    w1 = tr.gamma_weight(one, adv, one, one, k_pos=k, lambda_pos=lam, k_neg=k, lambda_neg=lam)
    assert w1.item() == pytest.approx(1.0, rel=1e-12)
    peak = k / lam
    assume(math.log(1e-8) < math.log(max(peak, 1e-300)) < 20)
    grid = torch.tensor([peak * 0.9, peak, peak * 1.1], dtype=F64)
    w = tr.gamma_weight(grid, adv.expand(3), grid, grid, k_pos=k, lambda_pos=lam, k_neg=k, lambda_neg=lam)
    assert w[1] >= w[0] and w[1] >= w[2]


@SETTINGS
@given(rho=st.sampled_from([0.0, 1e-300, 1e-9, 1.0, 1e9, float("inf")]),
       a=st.sampled_from([-1.0, 0.0, 1.0]))
def test_gamma_weight_is_finite_for_any_ratio(rho, a):
    r = torch.tensor([rho], dtype=F64)
    w = tr.gamma_weight(r, torch.tensor([a], dtype=F64), r, r, k_pos=2.0, lambda_pos=3.0,
                        k_neg=3.0, lambda_neg=2.0)
    assert torch.isfinite(w).all() and (w >= 0).all()


# ---------------------------------------------------------------- straight-through KL


@SETTINGS
@given(seed=seeds, which=st.sampled_from(["k1", "abs", "k3", "k3c"]))
def test_straight_through_has_the_base_value_and_k2_gradient(seed, which):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(20, generator=g, dtype=F64).requires_grad_(True)
    ref = torch.randn(20, generator=g, dtype=F64) * 3
    one = torch.ones(20, dtype=F64)

    def est(st_):
        if which == "k1":
            return kl.k1(logp, ref, one, straight_through=st_)
        if which == "abs":
            return kl.abs_(logp, ref, one, straight_through=st_)
        return kl.k3(logp, ref, one, clamp=which == "k3c", ratio_weighted=False, straight_through=st_)

    v_st, v = est(True), est(False)
    torch.testing.assert_close(v_st, v, rtol=0, atol=0)
    (g_st,) = torch.autograd.grad(v_st.sum(), logp)
    (g_k2,) = torch.autograd.grad(kl.k2(logp, ref, one).sum(), logp)
    torch.testing.assert_close(g_st, g_k2, rtol=0, atol=0)


# ---------------------------------------------------------------- token_sum micro-batches


@SETTINGS
@given(seed=seeds, cut=st.integers(1, 5))
def test_token_sum_is_exact_over_micro_batches(seed, cut):
    logp, old, _, mask, adv = batch(seed)
    f = fn("trust_region dual_clip\naggregation token_sum")
    whole, g_whole = grad(f, logp, old, adv, mask)
    den = f.denominator(mask[:cut]) + f.denominator(mask[cut:])
    parts = [grad(f, logp[s], old[s], adv[s], mask[s], denominator=den)
             for s in (slice(0, cut), slice(cut, None))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), g_whole, rtol=1e-12, atol=1e-14)
    rho = torch.exp(torch.clamp(logp - old, -20, 20))
    w = torch.where(adv >= 0, rho.clamp(max=1.2), rho.clamp(min=0.8).clamp(max=3.0))
    assert whole.item() == pytest.approx((-adv * w * mask).sum().item(), rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- baselines by definition


@st.composite
def groups(draw, min_g=1):
    G = draw(st.integers(min_g, 6))
    P = draw(st.integers(1, 4))
    r = draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, -2.0, 3.5]), min_size=P * G, max_size=P * G))
    lengths = draw(st.lists(st.integers(0, 5), min_size=P * G, max_size=P * G))
    return r, G, lengths


def f64(r, G, lengths):
    mask = (torch.arange(5).expand(len(r), 5) < torch.tensor(lengths).unsqueeze(-1)).to(F64)
    rt = torch.tensor(r, dtype=F64)
    return AdvantageBatch(rewards=rt, raw_rewards=rt, token_rewards=torch.zeros_like(mask), mask=mask,
                          group_size=G)


@SETTINGS
@given(groups(min_g=2))
def test_leave_one_out_max_is_max_minus_max_of_the_others(rg):
    r, G, lengths = rg
    a = bl.leave_one_out_max(f64(r, G, [5] * len(r)))[0][:, 0]
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        for j in range(G):
            others = grp[:j] + grp[j + 1:]
            assert a[g * G + j].item() == pytest.approx(max(grp) - max(others), abs=1e-12)


@SETTINGS
@given(groups(min_g=2))
def test_length_weighted_advantages_have_zero_length_weighted_sum(rg):
    """sum_i L_i A_i = 0 in every group (OPO's baseline definition); equal lengths: group_mean."""
    r, G, lengths = rg
    a = bl.length_weighted_mean(f64(r, G, lengths))[0][:, 0]  # column 0 holds A_i of a non-empty row
    L = torch.tensor(lengths, dtype=F64)
    sums = (a * L).view(-1, G).sum(-1)
    assert torch.all(sums.abs() <= 1e-12 * (1 + max(abs(x) for x in r)) * (1 + L.sum()))
    same = f64(r, G, [5] * len(r))
    torch.testing.assert_close(bl.length_weighted_mean(same)[0], bl.group_mean(same)[0], rtol=0, atol=1e-12)


@SETTINGS
@given(seed=seeds, gamma=st.floats(0, 1))
def test_return_to_go_recursion(seed, gamma):
    """G_t = r_t + gamma G_next on consecutive response tokens, 0 off the response; an outcome
    reward with gamma = 1 gives every token of its row that reward."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(4, 8, generator=g) < 0.7).to(F64)
    tr_ = torch.randn(4, 8, generator=g, dtype=F64)
    b = AdvantageBatch(rewards=torch.zeros(4, dtype=F64), raw_rewards=torch.zeros(4, dtype=F64),
                       token_rewards=tr_, mask=mask, group_size=1)
    G_ = bl.return_to_go(b, gamma=gamma)[0]
    for i in range(4):
        idx = [t for t in range(8) if mask[i, t] > 0]
        for a_, b_ in zip(idx, idx[1:]):
            assert G_[i, a_].item() == pytest.approx(tr_[i, a_].item() + gamma * G_[i, b_].item(), abs=1e-12)
        if idx:
            assert G_[i, idx[-1]].item() == pytest.approx(tr_[i, idx[-1]].item(), abs=1e-15)
    assert torch.count_nonzero(G_[mask == 0]) == 0
    last = torch.zeros_like(tr_)
    last[:, -1] = 2.5
    full = torch.ones(4, 8, dtype=F64)
    b1 = AdvantageBatch(rewards=torch.zeros(4, dtype=F64), raw_rewards=torch.zeros(4, dtype=F64),
                        token_rewards=last, mask=full, group_size=1)
    assert torch.all(bl.return_to_go(b1, gamma=1.0)[0] == 2.5)


# ---------------------------------------------------------------- DRO and the product ratio


@SETTINGS
@given(seed=seeds, beta=st.floats(1e-3, 10))
def test_dro_gradient_at_zero_advantage_is_the_penalty(seed, beta):
    logp, old, _, mask, adv = batch(seed)
    f = spec_fn(f"ratio token(clamp=80.0)\nobjective dro(beta={beta!r})")
    _, g = grad(f, logp, old, adv * 0, mask)
    want = beta * (logp - old) * mask / mask.sum().clamp_min(1)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-14)


@SETTINGS
@given(seed=seeds)
def test_product_ratio_gradient_is_one_sequence_term_per_row(seed):
    """With seq_mean_token_mean, -A w_i on every token is the loss -1/N sum_i A_i prod_t rho_it."""
    logp, old, _, mask, adv = batch(seed, spread=0.2)
    f = fn("ratio product(clamp=20.0)\naggregation seq_mean_token_mean")
    loss, g = grad(f, logp, old, adv, mask)
    lp = logp.clone().requires_grad_(True)
    a_row = adv.sum(-1) / mask.sum(-1).clamp_min(1)
    seq = torch.exp(((lp - old) * mask).sum(-1))
    n = (mask.sum(-1) > 0).sum().clamp_min(1)
    want = (-a_row * seq * (mask.sum(-1) > 0)).sum() / n
    (g_want,) = torch.autograd.grad(want, lp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-13)
