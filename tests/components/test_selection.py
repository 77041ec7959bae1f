"""The selection slot against TRL's top_entropy_quantile and off_policy_mask_threshold
(correction_refs.py), float64 value and gradient; the denominator stays the valid-token count;
deselected tokens get exactly zero policy gradient; compiled == eager."""
from __future__ import annotations

import pytest
import torch

from component_refs import spec_fn
from correction_refs import trl_high_entropy_mask, trl_selected
from test_correction import TRL_PPO, batch

CASES = [
    ("top_entropy(quantile=0.2)", dict(top_entropy_quantile=0.2), {}),
    ("top_entropy(quantile=0.5)", dict(top_entropy_quantile=0.5), {}),
    ("top_entropy(quantile=1.0)", dict(top_entropy_quantile=1.0), {}),
    ("off_policy_sequence(threshold=0.05)", dict(off_policy_mask_threshold=0.05), {}),
    ("off_policy_sequence(threshold=0.05)", dict(off_policy_mask_threshold=0.05, sampling="roll"),
     dict(rollout=True)),
    ("top_entropy(quantile=0.3), off_policy_sequence(threshold=0.0)",
     dict(top_entropy_quantile=0.3, off_policy_mask_threshold=0.0, sampling="roll"), dict(rollout=True)),
]


def _run(line: str, b: dict, rollout: bool = False, compile: bool = False, name: str = "t"):
    fn = spec_fn(TRL_PPO + "selection " + line, name=name, compile=compile)
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], entropy=b["ent"],
                  rollout_logprobs=b["roll"] if rollout else None)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("line,kw,call", CASES, ids=[f"{c[0]}{' rollout' if c[2] else ''}" for c in CASES])
def test_trl_selection(line, kw, call, seed):
    b = batch(seed, nan=True)
    ours, g = _run(line, b, **call)
    kw = {**kw, "sampling": b["roll"]} if kw.get("sampling") == "roll" else kw
    lp = b["logp"].clone().requires_grad_(True)
    want = trl_selected({**b, "logp": lp}, **kw)
    (g_ref,) = torch.autograd.grad(want, lp)
    assert abs(ours.item() - want.item()) <= 1e-7 * max(1.0, abs(want.item()))
    assert (g - g_ref).abs().max().item() <= 1e-7 * max(1.0, g_ref.abs().max().item())


def test_selected_tokens_and_the_denominator():
    """objective reinforce: d/dlogp = -A keep / n with n the valid tokens of the whole batch."""
    b = batch(0)
    fn = spec_fn("objective reinforce\naggregation token_mean\nselection top_entropy(quantile=0.25)")
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], entropy=b["ent"])
    (g,) = torch.autograd.grad(out.loss, lp)
    keep = trl_high_entropy_mask(b["ent"], b["mask"], 0.75)
    frac = keep.sum() / (b["mask"] > 0).sum()
    assert 0.2 <= float(frac) <= 0.3
    live = keep & (b["adv"] != 0)
    assert torch.equal(g != 0, live)
    assert torch.allclose(g[live], -b["adv"][live] / b["mask"].sum())  # the denominator is all valid tokens


def test_compiled_equals_eager():
    b = {k: (v.float() if torch.is_tensor(v) else v) for k, v in batch(2).items()}
    line = "top_entropy(quantile=0.4), off_policy_sequence(threshold=0.02)"
    (l0, g0), (l1, g1) = (_run(line, b, rollout=True, compile=c, name="sc") for c in (False, True))
    assert torch.allclose(l0, l1, rtol=1e-5) and torch.allclose(g0, g1, rtol=1e-4, atol=1e-7)


def test_entropy_is_required():
    b = batch(0)
    fn = spec_fn("selection top_entropy(quantile=0.2)")
    with pytest.raises(ValueError, match="entropy= for selection top_entropy"):
        fn.loss(b["logp"], b["old"], b["adv"], b["mask"])
