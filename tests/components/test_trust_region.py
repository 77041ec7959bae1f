"""trust_region slot (with the objective it pairs with) against per-token loop references of
verl 0.9.1 / TRL 1.16 loss modes: each reference gives the per-token loss and its hand-derived
derivative d l / d logp; the loss is token_mean, so grad = dl * m / sum(m)."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import assert_close, lists, random_batch, spec_fn
from rldsl.components import trust_region as tr


def clampf(x: float, lo: float | None = None, hi: float | None = None) -> float:
    if lo is not None:
        x = max(x, lo)
    if hi is not None:
        x = min(x, hi)
    return x


# ---------------------------------------------------------------- per-token references
# each: (lp, old, A) -> (loss, d loss / d lp)


def verl_vanilla(lp, old, A, lo=0.2, hi=0.2, c=3.0):
    """compute_policy_loss_vanilla: log ratio clamped to +-20, max(-A r, -A clip(r)), dual clip for A<0."""
    x = lp - old
    inside = -20 < x < 20
    r = math.exp(clampf(x, -20, 20))
    pg1, pg2 = -A * r, -A * clampf(r, 1 - lo, 1 + hi)
    l1 = max(pg1, pg2)
    d_unclipped = -A * r * inside
    d1 = d_unclipped if (pg1 >= pg2 or 1 - lo < r < 1 + hi) else 0.0
    if A < 0 and -A * c < l1:
        return -A * c, 0.0
    return l1, d1


def trl_clip(lp, old, A, lo=0.2, hi=0.2):
    """TRL grpo/dapo: -min(r A, clip(r, 1-eps, 1+eps_high) A); no log-ratio clamp, no dual clip."""
    r = math.exp(lp - old)
    t1, t2 = r * A, clampf(r, 1 - lo, 1 + hi) * A
    if t1 <= t2 or 1 - lo < r < 1 + hi:
        return -t1 if t1 <= t2 else -t2, -A * r
    return -t2, 0.0


def verl_cispo(lp, old, A, lo, hi):
    """compute_policy_loss_cispo: -sg(clip(r, 1-lo, 1+hi)) A logp (two-sided)."""
    w = clampf(math.exp(clampf(lp - old, -20, 20)), 1 - lo, 1 + hi)
    return -w * A * lp, -w * A


def trl_cispo(lp, old, A, eps_high):
    """TRL loss_type="cispo": -sg(min(r, epsilon_high)) A logp (absolute cap)."""
    w = min(math.exp(lp - old), eps_high)
    return -w * A * lp, -w * A


def verl_dppo_tv(lp, old, A, lo, hi, c):
    p, p_old = math.exp(lp), math.exp(old)
    valid = (p - p_old <= hi) if A > 0 else (p - p_old >= -lo)
    w = min(math.exp(clampf(lp - old, -20, 20)), c)
    return -A * w * lp * valid, -A * w * valid


def verl_dppo_kl(lp, old, A, lo, hi, c):
    p, p_old = math.exp(lp), math.exp(old)
    d = p_old * (old - lp) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    valid = (d <= hi or p <= p_old) if A > 0 else (d <= lo or p >= p_old)
    w = min(math.exp(clampf(lp - old, -20, 20)), c)
    return -A * w * lp * valid, -A * w * valid


def check_token_mean(fn, ref, b, **kw):
    """fn.loss (token_mean) vs sum over tokens of the reference, value and gradient."""
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    m, L, O, A = lists(b["mask"]), lists(b["logp"]), lists(b["old"]), lists(b["adv"])
    n = sum(sum(r) for r in m)
    tot, grad = 0.0, []
    for i in range(len(m)):
        row = []
        for t in range(len(m[0])):
            if m[i][t] > 0:
                l_, d = ref(L[i][t], O[i][t], A[i][t])
                tot += l_
                row.append(d / n)
            else:
                row.append(0.0)
        grad.append(row)
    assert out.loss.item() == pytest.approx(tot / n, rel=1e-5, abs=1e-7)
    assert_close(g, grad, rtol=1e-4, atol=1e-7)
    return out


def wide_batch(seed: int, B: int = 8, T: int = 12):
    """A batch whose ratios reach well outside every clip range (log ratio in about +-1.5)."""
    b = random_batch(B, T, seed, empty_rows=(5,))
    g = torch.Generator().manual_seed(seed + 100)
    b["old"] = (b["logp"] + 0.7 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    return b


# ---------------------------------------------------------------- clip


def test_clip_hand_numbers():
    rho = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0])
    w = tr.clip(rho, adv, rho, rho, low=0.2, high=0.28)
    # A>0: min(rho, 1.28); A<0: max(rho, 0.8)
    assert lists(w) == pytest.approx([1.28, 0.5, 0.8, 1.5, 1.1])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28)])
def test_clip_equals_trl_grpo_loss(seed, lo, hi):
    fn = spec_fn(f"trust_region clip(low={lo}, high={hi})\nratio token(clamp=1000.0)")
    out = check_token_mean(fn, lambda lp, old, A: trl_clip(lp, old, A, lo, hi), wide_batch(seed))
    assert out.metrics["clip_fraction"] > 0  # the batch does reach the clip


# ---------------------------------------------------------------- dual_clip (verl vanilla)


def test_dual_clip_hand_numbers():
    rho = torch.tensor([5.0, 2.0, 0.5, 5.0, 1.5])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0])
    w = tr.dual_clip(rho, adv, rho, rho, low=0.2, high=0.2, c=3.0)
    # A<0: min(max(rho, 0.8), 3): 5 -> 3 (capped loss -A*3), 2 -> 2, 0.5 -> 0.8; A>0: min(rho, 1.2)
    assert lists(w) == pytest.approx([3.0, 2.0, 0.8, 1.2, 1.2])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("c", [3.0, 1.3, 10.0])
def test_verl_vanilla_is_token_ratio_plus_dual_clip(seed, c):
    fn = spec_fn(f"trust_region dual_clip(low=0.2, high=0.28, c={c})")
    b = wide_batch(seed)
    check_token_mean(fn, lambda lp, old, A: verl_vanilla(lp, old, A, 0.2, 0.28, c), b)
    if c == 1.3:  # the batch does hit the A<0 cap: the loss differs from plain clip
        plain = spec_fn("trust_region clip(low=0.2, high=0.28)")
        assert float(fn.loss(b["logp"], b["old"], b["adv"], b["mask"]).loss) != pytest.approx(
            float(plain.loss(b["logp"], b["old"], b["adv"], b["mask"]).loss), rel=1e-4)


# ---------------------------------------------------------------- truncate (CISPO)


def test_truncate_hand_numbers():
    rho = torch.tensor([7.0, 0.1, 1.1, 0.1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert lists(tr.truncate(rho, adv, rho, rho, high=4.0, low=None)) == pytest.approx([5.0, 0.1, 1.1, 0.1])
    assert lists(tr.truncate(rho, adv, rho, rho, high=0.2, low=0.5)) == pytest.approx([1.2, 0.5, 1.1, 0.5])


@pytest.mark.parametrize("seed", [0, 1])
def test_verl_cispo_two_sided_is_truncate_low_high(seed):
    fn = spec_fn("objective is_weighted\ntrust_region truncate(low=0.2, high=0.28)")
    check_token_mean(fn, lambda lp, old, A: verl_cispo(lp, old, A, 0.2, 0.28), wide_batch(seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_trl_cispo_absolute_cap_5_is_truncate_high_4(seed):
    fn = spec_fn("objective is_weighted\ntrust_region truncate(high=4.0)\nratio token(clamp=1000.0)")
    b = wide_batch(seed)
    b["old"] = b["old"] - 1.0  # ratios up to e^2.5: the cap 5 is reached
    assert bool(((b["logp"] - b["old"]).exp() * b["mask"] > 5).any())
    check_token_mean(fn, lambda lp, old, A: trl_cispo(lp, old, A, 5.0), b)


def test_cispo_library_is_verl_example_cap():
    """cispo.rl: truncate(high=0.2) with no lower bound = verl cispo with clip_ratio_low=10."""
    import rldsl
    fn = rldsl.compile(rldsl.load("cispo"), compile=False)
    b = wide_batch(3)
    check_token_mean(fn, lambda lp, old, A: verl_cispo(lp, old, A, 10.0, 0.2), b)


# ---------------------------------------------------------------- tv / kl_div (DPPO)


def test_tv_hand_numbers():
    # p_old = .5, p = .7: rise of .2 > .15 -> masked for A>0, allowed for A<0;
    # p = .3: fall of .2 -> masked for A<0, allowed for A>0
    logp = torch.tensor([0.7, 0.7, 0.3, 0.3, 0.6]).log()
    old = torch.full((5,), 0.5).log()
    rho = (logp - old).exp()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    w = tr.tv(rho, adv, logp, old, low=0.15, high=0.15, cap=None)
    assert lists(w) == pytest.approx([0.0, 1.4, 0.0, 0.6, 1.2])


def test_kl_div_hand_numbers():
    # p_old = .5, p = .7: D = .5 ln(.5/.7) + .5 ln(.5/.3) = 0.08718 > .05
    logp = torch.tensor([0.7, 0.7, 0.52]).log()
    old = torch.full((3,), 0.5).log()
    rho = (logp - old).exp()
    adv = torch.tensor([1.0, -1.0, 1.0])
    w = tr.kl_div(rho, adv, logp, old, low=0.05, high=0.05, cap=None)
    # A>0 and p rose past the bound -> 0; A<0 and p rose (p >= p_old) -> kept; small move kept
    assert lists(w) == pytest.approx([0.0, 1.4, 1.04])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cap", [3.0, 10000.0])
def test_verl_dppo_tv(seed, cap):
    fn = spec_fn(f"objective is_weighted\ntrust_region tv(low=0.15, high=0.1, cap={cap})")
    out = check_token_mean(fn, lambda lp, old, A: verl_dppo_tv(lp, old, A, 0.15, 0.1, cap), wide_batch(seed))
    assert out.metrics["clip_fraction"] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_verl_dppo_kl(seed):
    fn = spec_fn("objective is_weighted\ntrust_region kl_div(low=0.05, high=0.03, cap=3.0)")
    out = check_token_mean(fn, lambda lp, old, A: verl_dppo_kl(lp, old, A, 0.05, 0.03, 3.0), wide_batch(seed))
    assert out.metrics["clip_fraction"] > 0


def test_dppo_paper_form_gradient_equals_verl_without_cap():
    """dppo.rl's form (objective ppo): l = -A rho valid; its gradient -A rho valid equals verl's
    -A sg(min(rho, c)) logp valid gradient when the cap is off."""
    fn = spec_fn("trust_region tv(low=0.15, high=0.15)")

    def ref(lp, old, A):
        _, d = verl_dppo_tv(lp, old, A, 0.15, 0.15, 1e30)
        p, p_old = math.exp(lp), math.exp(old)
        valid = (p - p_old <= 0.15) if A > 0 else (p - p_old >= -0.15)
        return -A * math.exp(lp - old) * valid, d

    out = check_token_mean(fn, ref, wide_batch(4))
    assert out.metrics["clip_fraction"] > 0


# ---------------------------------------------------------------- ratios far outside the range


TRUST_REGIONS = ["clip(low=0.2, high=0.2)", "dual_clip(low=0.2, high=0.2, c=3.0)",
                 "tv(low=0.15, high=0.15)", "kl_div(low=0.05, high=0.05)", "none"]


@pytest.mark.parametrize("region", TRUST_REGIONS)
def test_log_ratio_plus_minus_30_finite_and_zero_grad_where_clipped(region):
    fn = spec_fn(f"trust_region {region}")
    old = torch.tensor([[-40.0, -1.0, -1e-3, -31.0]])  # logp - old = +30, -30, -30 (via logp), +30
    logp = torch.tensor([[-10.0, -31.0, -30.0, -1.0]], requires_grad=True)
    for A in (1.0, -1.0):
        out = fn.loss(logp, old, torch.full((1, 4), A), torch.ones(1, 4))
        (g,) = torch.autograd.grad(out.loss, logp)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all()
        # |log ratio| = 30 > verl's ratio clamp 20: the ratio carries no gradient
        assert torch.count_nonzero(g) == 0, (region, A, g)


def test_clip_zero_grad_where_clipped_without_ratio_clamp():
    fn = spec_fn("trust_region clip(low=0.2, high=0.2)\nratio token(clamp=1000.0)")
    logp = torch.tensor([[-1.0, -31.0, -1.0, -31.0]], requires_grad=True)
    old = torch.tensor([[-31.0, -1.0, -31.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])  # clipped, clipped, unclipped (huge), unclipped (tiny)
    out = fn.loss(logp, old, adv, torch.ones(1, 4))
    (g,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == pytest.approx((-1.2 + 0.8 + math.exp(30) - math.exp(-30)) / 4, rel=1e-5)
    assert g[0, 0] == 0 and g[0, 1] == 0
    assert float(g[0, 2]) == pytest.approx(math.exp(30) / 4, rel=1e-5)


def test_tv_masks_far_moves_without_ratio_clamp():
    fn = spec_fn("trust_region tv(low=0.15, high=0.15)\nratio token(clamp=1000.0)")
    logp = torch.tensor([[-30.0, -30.0]], requires_grad=True)  # p fell from ~1 to ~0
    old = torch.tensor([[-1e-3, -1e-3]])
    out = fn.loss(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    (g,) = torch.autograd.grad(out.loss, logp)
    rho = math.exp(-30 + 1e-3)
    assert out.loss.item() == pytest.approx(-rho / 2, rel=1e-5)  # only the A>0 token is kept
    assert g[0, 0] == 0 and float(g[0, 1]) == pytest.approx(-rho / 2, rel=1e-5)


def test_truncate_keeps_gradient_far_outside():
    """CISPO: the weight is capped, the gradient -sg(w) A never vanishes."""
    fn = spec_fn("objective is_weighted\ntrust_region truncate(high=0.2)")
    logp = torch.tensor([[-1.0, -31.0]], requires_grad=True)
    old = torch.tensor([[-31.0, -1.0]])
    out = fn.loss(logp, old, torch.ones(1, 2), torch.ones(1, 2))
    (g,) = torch.autograd.grad(out.loss, logp)
    assert lists(g[0]) == pytest.approx([-1.2 / 2, -math.exp(-20) / 2], rel=1e-5)
