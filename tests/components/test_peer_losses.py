"""Every TRL 1.16 / verl 0.9.1 loss option that existing slots express (peer_cases.LOSS_CASES),
written as a spec and compared, value and gradient in float64, with an independent transcription
of the peer's own code (peer_refs.py) on batches with an empty row, a zero-advantage row and log
ratios of +-25 (beyond every clip bound and verl's +-20 clamps)."""
from __future__ import annotations

import pytest
import torch

from peer_cases import LOSS_CASES, fn_for, loss_batch, run_loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.name)
def test_loss_and_gradient_equal_the_peer(case, seed):
    b = loss_batch(seed)
    ours, ref, g, g_ref = run_loss(case, b)
    assert torch.isfinite(ours) and torch.isfinite(g).all()
    scale = max(1.0, abs(ref.item()))
    assert abs(ours.item() - ref.item()) <= 1e-8 * scale, (ours.item(), ref.item())
    # verl's seq-mean-token-mean divides by |o_i| + 1e-8 (relative 2e-9 here); all else is exact
    gscale = max(1.0, g_ref.abs().max().item())
    assert (g - g_ref).abs().max().item() <= 1e-8 * gscale
    pad = b["mask"] == 0
    assert torch.count_nonzero(g[pad]) == 0, "padding and the empty row get no gradient"


def test_the_cases_reach_the_edges():
    """The batch does what the cases rely on: clips bind, clamps bind, a row is empty."""
    b = loss_batch(0)
    lr = b["logp"] - b["old"]
    assert lr.max() > 20 and lr.min() < -20  # beyond verl's log-ratio clamp
    assert (b["ref"] - b["logp"]).max() > 20  # beyond verl's k3 exponent clamp
    assert (b["mask"].sum(-1) == 0).any() and (b["a"] == 0).any()
    fn = fn_for("trust_region clip(low=0.2, high=0.28)")
    assert fn.loss(b["logp"], b["old"], b["adv"], b["mask"]).metrics["clip_fraction"] > 0.2


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.name)
def test_an_all_empty_batch_gives_zero_not_nan(case):
    """Where the peers divide 0 by 0 (verl token-mean, seq means), the spec gives loss 0 and no gradient."""
    b = loss_batch(5)
    b["mask"] = torch.zeros_like(b["mask"])
    b["adv"] = b["adv"] * 0
    fn = fn_for(case.spec)
    kw = {"ref_logprobs": b["ref"], "entropy": b["ent"], "group_size": 1, "rollout_logprobs": b["roll"]}
    lp = b["logp"].clone().requires_grad_(True)
    given = {"entropy": case.kw.get("entropy"), "rollout_logprobs": case.kw.get("roll")}
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], **{k: v for k, v in kw.items() if given.get(k, True)})
    (g,) = torch.autograd.grad(out.loss, lp)
    assert out.loss.item() == 0.0 and torch.count_nonzero(g) == 0
    assert all(v == v for v in out.metrics.values()), out.metrics  # no NaN metric


@pytest.mark.parametrize("case", [c for c in LOSS_CASES if any(w in c.spec for w in (
    "selection", "correction", "geo_mean", "kl_cov"))], ids=lambda c: c.name)
def test_the_selection_correction_and_covariance_cases_bind(case):
    """Each of these rows changes the loss against the same spec without its distinctive line (the
    selection / correction dropped, geo_mean -> the token ratio, kl_cov -> ppo) on seed 0 or 1
    (the e^25 ratios dominate the loss: any difference counts)."""
    lines = case.spec.splitlines()
    base = "\n".join(
        "ratio token(clamp=80.0)" if "geo_mean" in ln else "objective ppo" if "kl_cov" in ln
        else "correction bypass" if ln.startswith("correction bypass,") else ln
        for ln in lines if not ln.startswith("selection") and ln != "correction bypass")
    kw = {"group_size": 1, "entropy": None, "rollout_logprobs": None}
    differs = False
    for seed in (0, 1):
        b = loss_batch(seed)
        kw.update(entropy=b["ent"] if case.kw.get("entropy") else None,
                  rollout_logprobs=b["roll"] if "correction" in base else None)
        ours = fn_for(case.spec).loss(b["logp"], b["old"], b["adv"], b["mask"], **{
            **kw, "rollout_logprobs": b["roll"] if case.kw.get("roll") else None}).loss
        other = fn_for(base).loss(b["logp"], b["old"], b["adv"], b["mask"], **kw).loss
        differs |= ours.item() != other.item()  # the same ops but for the line: any change is the line's
    assert differs, (case.spec, base)
