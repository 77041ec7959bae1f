"""Formulas that re-express registry components give the registry's values and gradients.

Nine registry components written as ``define`` blocks (clip, dual_clip, truncate, the SAPO
soft_gate, leave_one_out with both singleton rules, group_std, token_mean, k3 in three
variants) are compared with the registry functions (the SAPO gate also with a hand-written
TRL / verl reference: -(4/tau) sigmoid(tau (rho - 1)) A, tau = tau_pos if A > 0 else
tau_neg), on random float64 batches (hypothesis, any seed) with padding (garbage values on
padded tokens), empty rows, groups of one, constant groups, failed rewards, A = 0 and
ratios exactly on the clip bounds. Tolerance 1e-6.

Where both branches of a ``where`` are computed, a division in the branch not taken must be
guarded (``max(K - 1, 1)``), as the registry's code does with ``clamp_min``: otherwise its
gradient is 0 * inf = NaN (docs/formulas.md).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rldsl
from rldsl.components import aggregation as agg
from rldsl.components import baseline as bl
from rldsl.components import kl as kl_mod
from rldsl.components import normalizer as nz
from rldsl.components import trust_region as tr
from rldsl.formula import hooks
from rldsl.ops import AdvantageBatch

SETTINGS = settings(max_examples=30, deadline=None)
TOL = dict(rtol=1e-6, atol=1e-6, equal_nan=True)

DEFINES = {
    "clip": ("trust_region", """
        low = 0.2
        high = 0.2
        w = where(A >= 0, min(rho, 1 + high), max(rho, 1 - low))"""),
    "dual_clip": ("trust_region", """
        low = 0.2
        high = 0.2
        c = 3.0
        w = where(A >= 0, min(rho, 1 + high), min(max(rho, 1 - low), c))"""),
    "truncate": ("trust_region", """
        high = 0.2
        w = min(rho, 1 + high)"""),
    "truncate_low": ("trust_region", """
        low = 0.2
        high = 0.2
        w = clamp(rho, 1 - low, 1 + high)"""),
    "sapo": ("trust_region", """
        tau_pos = 1.0
        tau_neg = 1.05
        tau = where(A > 0, tau_pos, tau_neg)
        w = sigmoid(tau * (rho - 1)) * 4 / tau"""),
    "k3": ("kl", """
        beta = 0.04
        x = ref_logp - logp
        kl = exp(x) - x - 1"""),
    "k3_clamped": ("kl", """
        beta = 0.04
        x = clamp(ref_logp - logp, -20, 20)
        kl = clamp(exp(x) - x - 1, -10, 10)"""),
    "k3_ratio_weighted": ("kl", """
        beta = 0.04
        x = ref_logp - logp
        kl = (exp(x) - x - 1) * rho"""),
    "token_mean": ("aggregation", """
        weights = mask
        count = batch_sum(mask)"""),
    "leave_one_out": ("baseline", """
        K = group_sum(1)
        A = where(K > 1, (r - group_mean(r)) * K / max(K - 1, 1), 0)"""),
    "leave_one_out_reward": ("baseline", """
        K = group_sum(1)
        A = where(K > 1, (r - group_mean(r)) * K / max(K - 1, 1), r)"""),
    "group_std": ("normalizer", """
        eps = 1e-6
        A = A / (group_std(r) + eps)"""),
}


def formula(name: str, **params: float):
    """The standalone function of define ``name`` used in its slot with ``params``."""
    slot, body = DEFINES[name]
    args = ", ".join(f"{k}={v!r}" for k, v in params.items())
    text = (f"algorithm eq_{name}\n  define f_{name}\n" +
            "\n".join("    " + ln.strip() for ln in body.strip().splitlines()) +
            f"\n  end\n  {slot}  f_{name}" + (f"({args})" if args else "") + "\n")
    if slot == "kl":
        text += "  objective  ppo\n"
    algo = rldsl.loads(text, filename=f"{name}.rl")
    return hooks.function(algo[slot])


# ---------------------------------------------------------------------------------------
# Batches


def _lengths(g: torch.Generator, B: int, T: int) -> torch.Tensor:
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[torch.rand(B, generator=g) < 0.2] = 0  # empty rows
    return lengths


@st.composite
def token_batch(draw, bounds: tuple[str, ...] = ()):
    """float64 [B, T] per-token inputs; padded tokens hold garbage; ``bounds`` are the params
    whose clip bounds some ratios sit on exactly."""
    B, T = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.arange(T).expand(B, T) < _lengths(g, B, T).unsqueeze(-1)).double()
    logp = torch.log(0.02 + 0.97 * torch.rand(B, T, generator=g, dtype=torch.float64))
    old = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rho = torch.exp(0.6 * torch.randn(B, T, generator=g, dtype=torch.float64))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[torch.rand(B, T, generator=g) < 0.2] = 0.0  # A = 0 exactly
    pad = mask == 0
    rho[pad] = 50.0 * torch.rand(int(pad.sum()), generator=g, dtype=torch.float64)  # garbage padding
    logp[pad], ref[pad] = -30.0, 5.0
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)  # d(sum(out * weights))
    return dict(mask=mask, logp=logp, old=old, ref=ref, rho=rho, adv=adv, weights=weights, g=g)


def on_bounds(b: dict, values: list[float]) -> None:
    """Put some ratios exactly on the given values (clip bounds: the gradient's edge)."""
    rho, g = b["rho"], b["g"]
    for v in values:
        rho[torch.rand(rho.shape, generator=g) < 0.15] = v


@st.composite
def reward_batch(draw):
    """float64 rewards [B] of P groups of G (groups of one, constant groups, failed rewards)."""
    P, G, T = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    B = P * G
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    r = torch.randn(B, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        r = (r > 0).double()  # binary rewards: constant groups are common
    if P > 1 and draw(st.booleans()):
        r[:G] = 0.7  # one constant group
    valid = torch.rand(B, generator=g) > 0.15  # failed rewards are left out of group statistics
    mask = (torch.arange(T).expand(B, T) < _lengths(g, B, T).unsqueeze(-1)).double()
    mask[~valid] = 0.0  # their rows leave the loss (as CompiledAlgorithm.estimate does)
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)
    return dict(r=r, G=G, valid=valid, mask=mask, weights=weights)


def _grad(out: torch.Tensor, leaf: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad((torch.nan_to_num(out) * weights).sum(), leaf, allow_unused=True,
                               retain_graph=True)
    return torch.zeros_like(leaf) if g is None else g


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL)


def compare_trust_region(name: str, b: dict, reference, **params: float) -> None:
    fn = formula(name, **params)
    rho_a = b["rho"].clone().requires_grad_(True)
    rho_b = b["rho"].clone().requires_grad_(True)
    got = fn(rho_a, None, b["adv"], b["logp"], b["old"], None, None, b["mask"], 1)["w"]
    want = reference(rho_b)
    same(got, want)
    same(_grad(got, rho_a, b["weights"]), _grad(want, rho_b, b["weights"]))


# ---------------------------------------------------------------------------------------
# Trust regions


low_ = st.floats(0.01, 0.95)
high_ = st.floats(0.01, 3.0)


@SETTINGS
@given(token_batch(), low_, high_)
def test_clip(b, low, high):
    on_bounds(b, [1 + high, 1 - low, 1.0])
    compare_trust_region("clip", b, lambda rho: tr.clip(rho, b["adv"], b["logp"], b["old"], low, high),
                         low=low, high=high)


@SETTINGS
@given(token_batch(), low_, high_, st.floats(1.01, 6.0))
def test_dual_clip(b, low, high, c):
    on_bounds(b, [1 + high, 1 - low, c])
    compare_trust_region("dual_clip", b,
                         lambda rho: tr.dual_clip(rho, b["adv"], b["logp"], b["old"], low, high, c),
                         low=low, high=high, c=c)


@SETTINGS
@given(token_batch(), high_)
def test_truncate(b, high):
    on_bounds(b, [1 + high])
    compare_trust_region("truncate", b,
                         lambda rho: tr.truncate(rho, b["adv"], b["logp"], b["old"], high, None), high=high)


@SETTINGS
@given(token_batch(), low_, high_)
def test_truncate_with_a_floor(b, low, high):
    on_bounds(b, [1 + high, 1 - low])
    compare_trust_region("truncate_low", b,
                         lambda rho: tr.truncate(rho, b["adv"], b["logp"], b["old"], high, low),
                         low=low, high=high)


@SETTINGS
@given(token_batch(), st.floats(0.05, 5.0), st.floats(0.05, 5.0))
def test_sapo_gate_against_a_hand_written_reference(b, tau_pos, tau_neg):
    def sapo(rho):  # TRL loss_type="sapo" / verl loss_mode="sapo", as the loss -A * w
        tau = torch.where(b["adv"] > 0, torch.full_like(rho, tau_pos), torch.full_like(rho, tau_neg))
        return (4.0 / tau) * torch.sigmoid(tau * (rho - 1.0))
    compare_trust_region("sapo", b, sapo, tau_pos=tau_pos, tau_neg=tau_neg)


@SETTINGS
@given(token_batch(), st.floats(0.05, 5.0), st.floats(0.05, 5.0))
def test_sapo_gate_against_the_registry_soft_gate(b, tau_pos, tau_neg):
    compare_trust_region("sapo", b, lambda rho: tr.soft_gate(rho, b["adv"], b["logp"], b["old"], tau_pos, tau_neg),
                         tau_pos=tau_pos, tau_neg=tau_neg)


# ---------------------------------------------------------------------------------------
# KL


@SETTINGS
@given(token_batch(), st.sampled_from([(False, False), (True, False), (False, True)]))
def test_k3(b, variant):
    clamp, ratio_weighted = variant
    name = "k3_clamped" if clamp else "k3_ratio_weighted" if ratio_weighted else "k3"
    fn = formula(name)
    la, lb = b["logp"].clone().requires_grad_(True), b["logp"].clone().requires_grad_(True)
    ra, rb = b["rho"].clone().requires_grad_(True), b["rho"].clone().requires_grad_(True)
    got = fn(ra, None, b["adv"], la, b["old"], b["ref"], None, b["mask"], 1)["kl"]
    want = kl_mod.k3(lb, b["ref"], rb, clamp, ratio_weighted)
    same(got, want)
    same(_grad(got, la, b["weights"]), _grad(want, lb, b["weights"]))
    same(_grad(got, ra, b["weights"]), _grad(want, rb, b["weights"]))


# ---------------------------------------------------------------------------------------
# Aggregation


@SETTINGS
@given(token_batch())
def test_token_mean(b):
    got = formula("token_mean")(None, None, b["adv"], b["logp"], b["old"], None, None, b["mask"], 1)
    weights, count = agg.token_mean(b["mask"], 1)
    same(got["weights"], weights)
    same(torch.as_tensor(got["count"]), count)


# ---------------------------------------------------------------------------------------
# Baseline and normalizer (advantage stage)


def _batch(d: dict, r: torch.Tensor) -> AdvantageBatch:
    return AdvantageBatch(rewards=r, raw_rewards=r, token_rewards=torch.zeros_like(d["mask"]),
                          mask=d["mask"], group_size=d["G"], valid=d["valid"])


def _valid_rows(x: torch.Tensor, d: dict) -> torch.Tensor:
    return x[d["valid"]]


@pytest.mark.parametrize("singleton", ["zero", "reward"])
@SETTINGS
@given(d=reward_batch())
def test_leave_one_out(singleton, d):
    """Both registry behaviours of a sample without a scorable other (singleton=zero | reward)."""
    ra, rb = d["r"].clone().requires_grad_(True), d["r"].clone().requires_grad_(True)
    name = "leave_one_out" if singleton == "zero" else "leave_one_out_reward"
    got = formula(name)(ra, None, d["mask"], d["G"], _batch(d, ra))["A"]
    want, returns = bl.leave_one_out(_batch(d, rb), singleton=singleton)
    # rows whose reward failed are masked out of the loss; the registry leaves garbage there
    same(_valid_rows(got, d), _valid_rows(want, d))
    keep = d["weights"] * d["valid"].unsqueeze(-1)
    same(_grad(got, ra, keep), _grad(want, rb, keep))


@SETTINGS
@given(reward_batch(), st.floats(0.0, 1e-2))
def test_group_std(d, eps):
    adv = (d["r"] - d["r"].mean()).unsqueeze(-1) * d["mask"]  # any centred advantage
    ra, rb = d["r"].clone().requires_grad_(True), d["r"].clone().requires_grad_(True)
    got = formula("group_std", eps=eps)(ra, adv, d["mask"], d["G"], _batch(d, ra))["A"]
    want = nz.group_std(adv, _batch(d, rb), eps, True)
    same(_valid_rows(got, d), _valid_rows(want, d))
    keep = d["weights"] * d["valid"].unsqueeze(-1)
    g_got, g_want = _grad(got, ra, keep), _grad(want, rb, keep)
    # the registry's gradient is NaN for a group of one (sqrt(0) in the branch std = 1 does not
    # take); the formula's masked std does not compute it: 0 there. Compared where it is defined.
    defined = torch.isfinite(g_want)
    same(g_got[defined], g_want[defined])


def test_the_comparison_sees_a_difference():
    """The harness is not vacuous: a 1e-5 change of one clip bound is caught."""
    rho = torch.tensor([[0.5, 1.0, 1.3], [1.25, 0.7, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0], [1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(rho)
    got = formula("clip", low=0.2, high=0.2)(rho, None, adv, None, None, None, None, mask, 1)["w"]
    same(got, tr.clip(rho, adv, None, None, 0.2, 0.2))
    try:
        same(got, tr.clip(rho, adv, None, None, 0.2, 0.2 + 1e-5))
    except AssertionError:
        return
    raise AssertionError("a 1e-5 change of a clip bound went unnoticed")
