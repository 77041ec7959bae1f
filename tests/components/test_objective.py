"""objective slot: the surrogate's value and where its gradient flows (through w or not)."""
from __future__ import annotations

import pytest
import torch

from component_refs import lists
from rldsl.components import objective as ob


def grads(fn):
    w = torch.tensor([1.5, 0.5, 2.0], requires_grad=True)
    logp = torch.tensor([-0.5, -2.0, -1.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    out = fn(w, adv, logp, torch.ones(3))
    gw, glp = torch.autograd.grad(out.sum(), (w, logp), allow_unused=True)
    return lists(out), gw, glp


def test_ppo_is_minus_a_w_with_gradient_through_w():
    val, gw, glp = grads(ob.ppo)
    assert val == pytest.approx([-1.5, 1.0, -1.0])
    assert lists(gw) == pytest.approx([-1.0, 2.0, -0.5])  # d/dw = -A
    assert glp is None or torch.count_nonzero(glp) == 0


def test_reinforce_is_minus_a_logp_and_ignores_w():
    val, gw, glp = grads(ob.reinforce)
    assert val == pytest.approx([0.5, -4.0, 0.5])
    assert lists(glp) == pytest.approx([-1.0, 2.0, -0.5])
    assert gw is None or torch.count_nonzero(gw) == 0


def test_is_weighted_stops_the_gradient_of_w():
    val, gw, glp = grads(ob.is_weighted)
    assert val == pytest.approx([0.75, -2.0, 1.0])  # -w A logp
    assert lists(glp) == pytest.approx([-1.5, 1.0, -1.0])  # -sg(w) A
    assert gw is None or torch.count_nonzero(gw) == 0
