"""A new algorithm written only as a spec in this test -- leave-one-out baseline, CISPO-style
stop-gradient IS weight truncated at 2, ScaleRL prompt-level averaging -- compiles with
torch.compile and matches a hand computation of its advantages, loss and gradient."""
from __future__ import annotations

import math

import pytest
import torch

import rldsl
from component_refs import assert_close, lists, random_batch

# torch.compile itself warns that torch.jit.script_method is deprecated
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
              pytest.mark.compile]

SPEC = """\
algorithm loo_trunc
  "Leave-one-out advantages, truncated IS-weighted policy gradient, prompt-level mean."
  baseline      leave_one_out
  objective     is_weighted
  trust_region  truncate(high=1.0)
  aggregation   prompt_mean
"""


@pytest.fixture()  # function scope: built after the compile marker is applied (rldsl caches the compiled loss)
def fn():
    return rldsl.compile(rldsl.loads(SPEC, filename="loo_trunc.rl"), compile=True)


def test_spec_resolves_to_the_written_slots(fn):
    a = fn.algorithm
    assert [a[s].component for s in ("baseline", "normalizer", "objective", "trust_region", "kl",
                                     "aggregation")] == \
        ["leave_one_out", "none", "is_weighted", "truncate", "none", "prompt_mean"]
    assert fn.compiled


def test_hand_computed_loss_and_gradient(fn):
    # P = 2 prompts x G = 2; lengths 2, 1 | 3, 1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    # leave-one-out: 1 - 0 = 1, 0 - 1 = -1 | 0.25 - 1 = -0.75, 1 - 0.25 = 0.75
    adv = fn.advantages(torch.tensor([1.0, 0.0, 0.25, 1.0]), 2, mask)
    assert_close(adv, [[1, 1, 0], [-1, 0, 0], [-0.75, -0.75, -0.75], [0.75, 0, 0]])
    logp = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0], [-0.2, -0.3, -0.4], [-3.0, 0.0, 0.0]],
                        requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, 0.0, 0.0], [-0.2, -1.0, -0.1], [-3.0, 0.0, 0.0]])
    # weights w = min(rho, 2): rho = 1, e^1.5 -> 2 | e^-0.5 | 1, e^0.7 -> 2, e^-0.3 | 1
    # per-token loss -w A logp:
    #   prompt 0: 1.0, 1.0, -e^-0.5 * 2 = -1.2130613           sum 0.7869387 over 3 tokens
    #   prompt 1: -0.15, -0.45, -0.3 e^-0.3 = -0.2222455, 2.25  sum 1.4277545 over 4 tokens
    # loss = (0.7869387 / 3 + 1.4277545 / 4) / 2 = (0.2623129 + 0.3569386) / 2 = 0.3096258
    out = fn.loss(logp, old, adv, mask, group_size=2)
    assert out.loss.item() == pytest.approx(0.3096258, rel=1e-6)
    assert out.loss.item() == pytest.approx(
        ((2 - 2 * math.exp(-0.5)) / 3 + (-0.6 - 0.3 * math.exp(-0.3) + 2.25) / 4) / 2, rel=1e-6)
    (g,) = torch.autograd.grad(out.loss, logp)
    # d/dlogp = -w A / (P * tokens of the prompt)
    assert_close(g, [[-1 / 6, -2 / 6, 0], [math.exp(-0.5) / 6, 0, 0],
                     [0.75 / 8, 1.5 / 8, 0.75 * math.exp(-0.3) / 8], [-0.75 / 8, 0, 0]])
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 7)  # the two truncated weights


def test_matches_a_loop_reference_on_a_random_batch(fn):
    G = 3
    b = random_batch(9, 10, 7, empty_rows=(4,))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 0.9, 0.1, 1.0, 1.0, 1.0])
    adv = fn.advantages(rewards, G, b["mask"])
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], adv, b["mask"], group_size=G)
    (g,) = torch.autograd.grad(out.loss, lp)
    r, M, L, O = lists(rewards), lists(b["mask"]), lists(b["logp"]), lists(b["old"])
    loss, grad, P_nonempty = 0.0, [[0.0] * 10 for _ in range(9)], 0
    per_prompt = []
    for p in range(3):
        rows = range(p * G, (p + 1) * G)
        n_tok = sum(sum(M[i]) for i in rows)
        if n_tok == 0:
            continue
        P_nonempty += 1
        s = 0.0
        for i in rows:
            a = r[i] - sum(r[j] for j in rows if j != i) / (G - 1)
            for t in range(10):
                if M[i][t]:
                    w = min(math.exp(L[i][t] - O[i][t]), 2.0)
                    s += -w * a * L[i][t]
                    grad[i][t] = -w * a / n_tok
        per_prompt.append(s / n_tok)
    loss = sum(per_prompt) / P_nonempty
    grad = [[x / P_nonempty for x in row] for row in grad]
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    assert_close(g, grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(g[6:]) == 0  # the all-pass prompt has A = 0
