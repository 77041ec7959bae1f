"""critic slot: verl compute_value_loss, 0.5 * agg(max((V-R)^2, (clip(V, V_old +- c) - R)^2))."""
from __future__ import annotations

import pytest
import torch

from component_refs import assert_close, lists, random_batch, spec_fn
from rldsl.components import critic as cr


def verl_value_loss(v: float, v_old: float, R: float, c: float) -> tuple[float, float]:
    """Per token (loss, d loss / d V)."""
    vc = min(max(v, v_old - c), v_old + c)
    l1, l2 = (v - R) ** 2, (vc - R) ** 2
    if l1 >= l2:
        return 0.5 * l1, (v - R)
    return 0.5 * l2, (vc - R) if v_old - c < v < v_old + c else 0.0


def test_value_loss_hand_numbers():
    values = torch.tensor([1.0, 0.3, -1.0], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0])
    ret = torch.tensor([0.8, 1.0, 1.0])
    loss = cr.value(values, old, ret, clip=0.5)
    # V=1 clipped to .5: max(.04, .09) = .09 -> .045 and no gradient; V=.3 inside: .49 -> .245;
    # V=-1 clipped to -.5: max(4, 2.25) = 4 (unclipped) -> 2
    assert lists(loss) == pytest.approx([0.045, 0.245, 2.0])
    (g,) = torch.autograd.grad(loss.sum(), values)
    assert lists(g) == pytest.approx([0.0, -0.7, -2.0])
    assert lists(cr.value(values, None, ret, clip=0.5)) == pytest.approx([0.02, 0.245, 2.0])


@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_verl_with_coef(seed):
    fn = spec_fn("baseline gae(gamma=1.0, lam=0.95)\ncritic value(clip=0.2, coef=0.5)\ntrust_region clip")
    b = random_batch(5, 6, seed, empty_rows=(2,))
    v = b["values"].clone().requires_grad_(True)
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], values=v, returns=b["returns"],
                  old_values=b["old_values"])
    (g,) = torch.autograd.grad(out.value_loss, v, retain_graph=True)
    M, V, VO, R = lists(b["mask"]), lists(b["values"]), lists(b["old_values"]), lists(b["returns"])
    n = sum(map(sum, M))
    tot, grad = 0.0, []
    for i in range(5):
        row = []
        for t in range(6):
            lv, d = verl_value_loss(V[i][t], VO[i][t], R[i][t], 0.2) if M[i][t] else (0.0, 0.0)
            tot += lv
            row.append(0.5 * d / n if M[i][t] else 0.0)
        grad.append(row)
    assert out.value_loss.item() == pytest.approx(0.5 * tot / n, rel=1e-5)
    assert_close(g, grad, rtol=1e-4, atol=1e-7)
    assert out.metrics["value_loss"] == pytest.approx(out.value_loss.item())
    # the policy loss does not depend on the values
    assert torch.autograd.grad(out.loss, v, allow_unused=True)[0] is None
