"""Property tests (hypothesis): baselines, padding invariance, trust-region gradient masks and
micro-batch exactness of every aggregation.

Each property holds for every draw, under any ``--hypothesis-seed``: where exactness is the
point (padding, micro-batches, gradient masks) the tensors are float64 and the tolerances
are those of float64 summation order; float32 properties use tolerances from float32's
epsilon and the magnitudes involved.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from component_refs import adv_batch, random_batch, spec_fn
from rldsl.components import baseline as bl

SETTINGS = settings(max_examples=40, deadline=None)
EPS32 = torch.finfo(torch.float32).eps

reward = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw, max_g: int = 8, max_p: int = 5):
    G = draw(st.integers(1, max_g))
    P = draw(st.integers(1, max_p))
    r = draw(st.lists(reward, min_size=P * G, max_size=P * G))
    return r, G


# ---------------------------------------------------------------- baselines


@SETTINGS
@given(grouped_rewards())
def test_group_mean_advantages_sum_to_zero_in_each_group(rg):
    r, G = rg
    adv, _ = bl.group_mean(adv_batch(r, G, T=1))
    a = adv[:, 0].double().view(-1, G)
    scale = max(1.0, max(abs(x) for x in r))
    assert torch.all(a.sum(-1).abs() <= 8 * G * EPS32 * scale)  # float32 rounding of G terms
    for g in range(len(r) // G):  # a constant group gives exactly 0
        if len(set(r[g * G:(g + 1) * G])) == 1:
            assert torch.count_nonzero(a[g]) == 0


@SETTINGS
@given(grouped_rewards())
def test_leave_one_out_equals_its_definition(rg):
    r, G = rg
    adv, _ = bl.leave_one_out(adv_batch(r, G, T=1), singleton="zero")
    for i, x in enumerate(r):
        g = i // G
        group = r[g * G:(g + 1) * G]
        others = [r[j] for j in range(g * G, (g + 1) * G) if j != i]
        want = x - sum(others) / len(others) if others else 0.0
        # float32: the shifted rewards, their group sum and the division each round once
        tol = 8 * G * EPS32 * max(1.0, max(abs(y) for y in group))
        assert adv[i, 0].item() == pytest.approx(want, rel=0, abs=tol)


# ---------------------------------------------------------------- padding invariance

AGG_LINES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_mean(count_empty=true)",
             "seq_mean_token_sum", "seq_mean_token_sum(count_empty=true)",
             "token_sum_norm(max_tokens=16)", "prompt_mean"]
LOSS_LINES = {  # a loss around each aggregation that reads every per-token input
    "ppo_k3": "trust_region dual_clip\nkl k3(beta=0.1, where=loss)",
    "cispo_k3_trl": "objective is_weighted\ntrust_region truncate(high=4.0)\n"
                    "kl k3(beta=0.1, where=loss, ratio_weighted=true)",
    "gspo": "ratio sequence\ntrust_region clip(low=0.0003, high=0.0004)",
    "tv_entropy": "trust_region tv\nentropy bonus(coef=0.01)",
    "gae_critic": "baseline gae(gamma=1.0, lam=1.0)\ncritic value(clip=0.2)\ntrust_region clip",
}
_FNS: dict[tuple[str, str], object] = {}


def loss_fn(agg: str, loss: str):
    key = (agg, loss)
    if key not in _FNS:
        _FNS[key] = spec_fn(f"{LOSS_LINES[loss]}\naggregation {agg}")
    return _FNS[key]


FIELDS = ("logp", "old", "ref", "adv", "ent", "values", "returns", "old_values")


def run(fn, b, G):
    lp = b["logp"].clone().requires_grad_(True)
    v = b["values"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], ref_logprobs=b["ref"], values=v,
                  returns=b["returns"], old_values=b["old_values"], entropy=b["ent"], group_size=G)
    total = out.loss + (out.value_loss if out.value_loss is not None else 0.0)
    g_lp, g_v = torch.autograd.grad(total, (lp, v), allow_unused=True)
    g_v = torch.zeros_like(v) if g_v is None else g_v
    return total.detach(), g_lp, g_v, out.metrics


GARBAGE = st.sampled_from([float("inf"), -float("inf"), float("nan"), 1e30, -7.0])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.integers(1, 5), garbage=GARBAGE,
       agg=st.sampled_from(AGG_LINES), loss=st.sampled_from(sorted(LOSS_LINES)))
@example(seed=0, extra=1, garbage=float("inf"), agg="token_mean", loss="cispo_k3_trl")  # failed in float32
def test_padding_does_not_change_the_loss(seed, extra, garbage, agg, loss):
    """Appended padding columns (mask 0) and padding entries hold garbage (inf / NaN / huge):
    the loss, the metrics and the gradients of the real tokens do not change; with finite
    garbage the padding's gradients are exactly 0. In float64: padding changes the order of
    the sums, which moves a float32 loss by ~1e-6 relative (seed=0, extra=1, cispo_k3_trl)."""
    G = 2
    clean = random_batch(6, 5, seed, empty_rows=(seed % 6,), dtype=torch.float64)
    fn = loss_fn(agg, loss)
    padded = {"mask": torch.cat([clean["mask"], torch.zeros(6, extra, dtype=torch.float64)], 1)}
    for k in FIELDS:
        x = torch.cat([clean[k], torch.full((6, extra), garbage, dtype=torch.float64)], 1)
        x[:, :5] = torch.where(clean["mask"] > 0, clean[k], torch.full_like(clean[k], garbage))
        padded[k] = x
    l0, g0, gv0, m0 = run(fn, clean, G)
    l1, g1, gv1, m1 = run(fn, padded, G)
    assert torch.isfinite(l0)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-10, abs=1e-12)
    valid = clean["mask"] > 0
    torch.testing.assert_close(g1[:, :5][valid], g0[valid], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gv1[:, :5][valid], gv0[valid], rtol=1e-10, atol=1e-12)
    for k in ("pg_loss", "clip_fraction", "ratio_mean", "approx_kl"):  # metrics are reported as float32
        assert m1[k] == pytest.approx(m0[k], rel=4 * EPS32, abs=1e-12), k
    if math.isfinite(garbage) and abs(garbage) < 1e3:
        assert torch.count_nonzero(g1[padded["mask"] == 0]) == 0
        assert torch.count_nonzero(gv1[padded["mask"] == 0]) == 0


# ---------------------------------------------------------------- trust-region gradient masks


def blocked(region: str, lp: float, old: float, A: float) -> bool | None:
    """Whether the trust region stops the gradient of this token (None: too close to a boundary)."""
    rho = math.exp(lp - old)
    p, p_old = math.exp(lp), math.exp(old)
    if region == "clip":
        lo, hi = 1 - 0.2, 1 + 0.28
        if min(abs(rho - lo), abs(rho - hi)) < 1e-4:
            return None
        return (A > 0 and rho > hi) or (A < 0 and rho < lo)
    if region == "dual_clip":
        lo, hi, c = 1 - 0.2, 1 + 0.28, 3.0
        if min(abs(rho - lo), abs(rho - hi), abs(rho - c)) < 1e-4:
            return None
        return (A > 0 and rho > hi) or (A < 0 and (rho < lo or rho > c))
    if region == "tv":
        d = p - p_old
        if min(abs(d - 0.1), abs(d + 0.15)) < 1e-5:
            return None
        return (A > 0 and d > 0.1) or (A < 0 and d < -0.15)
    if region == "kl_div":
        D = p_old * (old - lp) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        if min(abs(D - 0.03), abs(D - 0.05)) < 1e-5:
            return None
        return (A > 0 and D > 0.03 and p > p_old) or (A < 0 and D > 0.05 and p < p_old)
    raise ValueError(region)


REGION_LINES = {"clip": "clip(low=0.2, high=0.28)", "dual_clip": "dual_clip(low=0.2, high=0.28, c=3.0)",
                "tv": "tv(low=0.15, high=0.1)", "kl_div": "kl_div(low=0.05, high=0.03)"}
REGION_FNS = {k: spec_fn(f"trust_region {v}\nratio token(clamp=1000.0)") for k, v in REGION_LINES.items()}

prob = st.floats(0.02, 0.98)
adv_value = st.one_of(st.floats(0.05, 3.0), st.floats(-3.0, -0.05))


@settings(max_examples=60, deadline=None)
@given(region=st.sampled_from(sorted(REGION_LINES)),
       tokens=st.lists(st.tuples(prob, prob, adv_value), min_size=1, max_size=12))
def test_gradient_is_zero_exactly_where_the_trust_region_blocks(region, tokens):
    lp = torch.tensor([[math.log(p) for p, _, _ in tokens]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(q) for _, q, _ in tokens]], dtype=torch.float64)
    adv = torch.tensor([[a for _, _, a in tokens]], dtype=torch.float64)
    want = [blocked(region, lp[0, i].item(), old[0, i].item(), adv[0, i].item()) for i in range(len(tokens))]
    assume(None not in want)
    out = REGION_FNS[region].loss(lp, old, adv, torch.ones_like(adv))
    (g,) = torch.autograd.grad(out.loss, lp)
    for i, b in enumerate(want):
        if b:
            assert g[0, i] == 0, (i, tokens[i])
        else:  # -A rho / n: never 0 here
            assert g[0, i].item() == pytest.approx(-adv[0, i].item() * math.exp(lp[0, i].item() - old[0, i].item())
                                                   / len(tokens), rel=1e-9)


# ---------------------------------------------------------------- micro-batch exactness


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGG_LINES), loss=st.sampled_from(sorted(LOSS_LINES)),
       split_group=st.integers(1, 3), empty=st.sampled_from([(), (0,), (0, 1), (4, 5, 6, 7)]))
def test_micro_batches_with_summed_denominator_equal_the_whole_batch(seed, agg, loss, split_group, empty):
    """Exact up to float64 summation order (float32 would differ by its rounding of the sums)."""
    G, B = 2, 8
    fn = loss_fn(agg, loss)
    b = random_batch(B, 6, seed, empty_rows=empty, dtype=torch.float64)
    whole_l, whole_g, whole_gv, _ = run(fn, b, G)
    cut = split_group * G
    parts = [{k: v[:cut] for k, v in b.items()}, {k: v[cut:] for k, v in b.items()}]
    den = fn.denominator(parts[0]["mask"], G) + fn.denominator(parts[1]["mask"], G)
    assert den.item() == pytest.approx(fn.denominator(b["mask"], G).item())
    vden = None  # the critic aggregates on its own (token_mean): its own global count
    if fn.algorithm.uses_critic:
        vden = fn.value_denominator(parts[0]["mask"], G) + fn.value_denominator(parts[1]["mask"], G)
        assert vden.item() == pytest.approx(fn.value_denominator(b["mask"], G).item())
    total, grads, grads_v = 0.0, [], []
    for part in parts:
        lp = part["logp"].clone().requires_grad_(True)
        v = part["values"].clone().requires_grad_(True)
        out = fn.loss(lp, part["old"], part["adv"], part["mask"], ref_logprobs=part["ref"], values=v,
                      returns=part["returns"], old_values=part["old_values"], entropy=part["ent"],
                      group_size=G, denominator=den, value_denominator=vden)
        t = out.loss + (out.value_loss if out.value_loss is not None else 0.0)
        g, gv = torch.autograd.grad(t, (lp, v), allow_unused=True)
        total += t.item()
        grads.append(g)
        grads_v.append(torch.zeros_like(v) if gv is None else gv)
    assert total == pytest.approx(whole_l.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), whole_g, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads_v), whole_gv, rtol=1e-10, atol=1e-12)
