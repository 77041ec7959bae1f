"""The old policy's per-token entropy ``old_ent`` (input ``old_entropy``) and the current one,
``ent``, in every loss slot that runs on the policy's values: Entropy-Ratio Clipping (ERC, Su et
al. 2025, arXiv 2512.05591; algorithms/examples/erc.rl) written as a spec equals an independent
hand-written reference of the authors' loss (verl ``grpo_erc`` of github.com/Kwai-Klear/ERC),
value and gradient, in float64."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import inputs
from rldsl.formula import lang

ROOT = Path(__file__).resolve().parents[2]
ERC = ROOT / "algorithms" / "examples" / "erc.rl"


def _batch(seed: int, B: int = 6, T: int = 9, V: int = 7):
    """Logits of the current and old policies over a vocabulary of V, sampled tokens, a
    right-padded mask with an empty row, advantages of both signs and a zero."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    z = (1.5 * torch.randn(B, T, V, generator=g, dtype=dt)).requires_grad_()
    # the old policy: sharper on some tokens, flatter on others, so that the entropy ratio
    # leaves (0.8, 1.2) on both sides on a good share of them
    temp = torch.exp(0.6 * torch.randn(B, T, 1, generator=g, dtype=dt))
    z_old = z.detach() * temp + 0.3 * torch.randn(B, T, V, generator=g, dtype=dt)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(dt)
    a = torch.randn(B, generator=g, dtype=dt)
    a[3] = 0.0
    return z, z_old, y, mask, a.unsqueeze(-1) * mask


def _logp_ent(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lsm = torch.log_softmax(z, -1)
    return lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def erc_reference(logp, old_logp, ent, old_ent, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=10.0,
                  ent_low=0.8, ent_high=1.2):
    """The authors' policy loss ``grpo_erc`` (dual-clip PPO with clip-higher, |log ratio| <= 20,
    then ``where(balanced, pg, pg.detach())``, token-mean), written again from the paper's
    definitions: balanced = low < (H + 1e-8) / (H_old + 1e-8) < high on the response tokens."""
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.min(-adv * clip_c, clipped)
    pg = torch.where(adv < 0, dual, clipped)
    q = (ent + 1e-8) / (old_ent + 1e-8)
    balanced = (q > ent_low) & (q < ent_high) & mask.bool()
    pg = torch.where(balanced, pg, pg.detach())
    return (pg * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_ratio_clipping_equals_the_authors_loss(seed: int) -> None:
    fn = rldsl.compile(rldsl.load(ERC))
    assert set(fn.algorithm.needs("loss")) >= {"entropy", "old_entropy"}
    z, z_old, y, mask, adv = _batch(seed)
    logp, ent = _logp_ent(z, y)
    with torch.no_grad():
        old_logp, old_ent = _logp_ent(z_old, y)
    q = ((ent + 1e-8) / (old_ent + 1e-8))[mask > 0]
    assert bool((q <= 0.8).any()) and bool((q >= 1.2).any()) and bool(((q > 0.8) & (q < 1.2)).any())

    out = fn.loss(logp, old_logp, adv, mask, entropy=ent, old_entropy=old_ent, group_size=1,
                  denominator=mask.sum())
    (grad,) = torch.autograd.grad(out.loss, z)
    logp2, ent2 = _logp_ent(z, y)
    want = erc_reference(logp2, old_logp, ent2, old_ent, adv, mask)
    (grad_ref,) = torch.autograd.grad(want, z)
    assert abs(float(out.loss.detach()) - float(want.detach())) < 1e-6
    assert float((grad - grad_ref).abs().max()) < 1e-6
    # the clipped tokens matter: without the entropy-ratio mask the gradient is another one
    logp3, ent3 = _logp_ent(z, y)
    plain = erc_reference(logp3, old_logp, ent3, old_ent, adv, mask, ent_low=-1.0, ent_high=1e9)
    (grad_plain,) = torch.autograd.grad(plain, z)
    assert float((grad_plain - grad_ref).abs().max()) > 1e-3


def test_ent_and_old_ent_are_readable_in_every_policy_slot_of_the_loss() -> None:
    """What the docs' table says: every loss slot that runs on the policy's values reads both
    (the aggregation's formula also runs in denominator(), which has only the mask)."""
    loss_slots = [s for s, fs in lang.SLOTS.items() if fs.stage == "loss" and s != "aggregation"]
    for name in ("ent", "old_ent"):
        assert [s for s in loss_slots if name not in lang.SLOTS[s].inputs] == []
    assert inputs.INPUTS["old_entropy"].source == "policy" and inputs.INPUTS["old_entropy"].formula == "old_ent"


def test_a_spec_reading_old_ent_makes_loss_ask_for_it() -> None:
    fn = rldsl.compile(rldsl.load(ERC))
    z, z_old, y, mask, adv = _batch(0)
    logp, ent = _logp_ent(z.detach(), y)
    with pytest.raises(Exception, match="old_entropy"):
        fn.loss(logp, logp, adv, mask, entropy=ent, group_size=1)
