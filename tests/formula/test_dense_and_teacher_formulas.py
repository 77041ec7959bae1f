"""Formulas read the teacher's logprobs (``teacher_logp``, loss slots) and the dense rewards
(``r_dense``, advantage slots) where the inputs table says the slot receives them: a
user-written on-policy distillation objective equals the library's ``opd`` (value and gradient,
float64), a baseline formula on per-turn rewards equals its hand computation, and both make a
run ask for the input they read."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rldsl

ROOT = Path(__file__).resolve().parents[2]
# opd.rl written by hand (algorithms/examples/opd_formula.rl)
OPD_FORMULA = (ROOT / "algorithms" / "examples" / "opd_formula.rl").read_text()

# Each token gets the sequence reward's margin over the batch mean, and a token that ends a turn
# also that turn's own reward.
DENSE_FORMULA = """
algorithm turn_credit extends reinforce
  "The outcome margin on every token, each turn's own reward on the token that ends it."
  define turn_credit
    A = r - batch_mean(r) + r_dense
  end
  baseline  turn_credit
"""


def _batch(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[:, 0] = 1.0
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = (logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return logp, old, teacher, mask


@pytest.mark.parametrize("seed", range(4))
def test_a_distillation_objective_written_as_a_formula_equals_opd(seed):
    mine = rldsl.compile(rldsl.loads(OPD_FORMULA), compile=False)
    lib = rldsl.compile(rldsl.load("opd"), compile=False)
    assert mine.algorithm.uses_teacher and "teacher_logprobs" in mine.algorithm.needs("loss")
    logp, old, teacher, mask = _batch(seed)
    zero = torch.zeros_like(mask)
    outs, grads = [], []
    for fn in (mine, lib):
        lp = logp.detach().clone().requires_grad_()
        out = fn.loss(lp, old, zero, mask, group_size=1, teacher_logprobs=teacher)
        out.loss.backward()
        outs.append(out.loss.detach())
        grads.append(lp.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    assert grads[0].abs().sum() > 0
    with pytest.raises(ValueError, match="teacher_logprobs="):
        mine.loss(logp, old, zero, mask, group_size=1)


def test_explain_code_shows_the_teacher_formula():
    spec = ROOT / "algorithms" / "examples" / "opd_formula.rl"
    out = subprocess.run([sys.executable, "-m", "rldsl.cli", "explain", "--code", str(spec)],
                         capture_output=True, text=True, check=True).stdout
    assert "def loss(" in out and "teacher_logp" in out.split("def loss(")[1].splitlines()[0]
    assert "= (teacher_logp - logp).detach()  # A_d = sg(teacher_logp - logp)" in out


def test_a_baseline_formula_reads_the_dense_rewards():
    fn = rldsl.compile(rldsl.loads(DENSE_FORMULA), compile=False)
    assert fn.algorithm.needs("advantage") == ["dense_rewards"]
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
    dense = torch.tensor([[0, 0.5, 0, 0, 1.0], [0, 0, 2.0, 0, 0]])
    r = dense.sum(-1)
    est = fn.estimate(r, 1, mask, dense_rewards=dense)
    want = (r - r.mean()).unsqueeze(-1) * mask + dense * mask  # [[-0.25 + ...], ...] by hand
    torch.testing.assert_close(est.advantages, want)
    with pytest.raises(ValueError, match="dense_rewards="):
        fn.estimate(r, 1, mask)
