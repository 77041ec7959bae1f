"""Compiled == eager for every library algorithm: loss, value loss, metrics and the gradients
wrt logprobs and values, on random batches (two shapes, a fully masked row, an all-masked batch).
Compiled objects come from the session fixture (torch.compile costs seconds per algorithm)."""
from __future__ import annotations


import pytest
import torch

import rldsl
from component_refs import random_batch

# torch.compile itself warns that torch.jit.script_method is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

ALGORITHMS = sorted(rldsl.library())
G = 4
BATCHES = [  # (B, T, seed, empty rows)
    (8, 16, 0, ()),
    (12, 24, 1, ()),          # a different B and T: no shape is baked into the compiled code
    (8, 16, 2, (3,)),         # a fully masked row
    (8, 16, 3, tuple(range(8))),  # nothing to learn from: loss 0, gradients 0
]


def run(fn, b):
    algo = fn.algorithm
    lp = b["logp"].clone().requires_grad_(True)
    v = b["values"].clone().requires_grad_(True)
    kw = {"group_size": G}
    if algo.kl_in == "loss":
        kw["ref_logprobs"] = b["ref"]
    if algo.uses_critic:
        kw.update(values=v, returns=b["returns"], old_values=b["old_values"])
    if algo.uses_entropy:
        kw["entropy"] = b["ent"]
    if "rollout_logprobs" in algo.needs():  # the engine's logprobs: another policy's (weights bind)
        kw["rollout_logprobs"] = b["ref"]
    if algo.uses_teacher:  # a teacher's numbers; the policy's top-k logprobs and JSD carry lp's gradient
        shifts = torch.tensor([0.0, 0.7, 1.9])
        teacher = {"teacher_logprobs": b["ref"], "teacher_topk_logprobs": b["ref"][..., None] - shifts,
                   "topk_logprobs": lp[..., None] - shifts.flip(0), "divergence": (lp - b["ref"]) ** 2}
        kw.update({k: v for k, v in teacher.items() if k in algo.needs()})
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], **kw)
    total = out.loss + (out.value_loss if out.value_loss is not None else 0.0)
    g_lp, g_v = torch.autograd.grad(total, (lp, v), allow_unused=True)
    return out, g_lp, g_v


@pytest.mark.slow  # a torch.compile of each library algorithm: seconds apiece, a minute or more in all
@pytest.mark.compile
@pytest.mark.parametrize("name", ALGORITHMS)
def test_compiled_equals_eager(name, compiled_algorithm, eager_algorithm):
    comp, eager = compiled_algorithm(name), eager_algorithm(name)
    assert comp.compiled and not eager.compiled
    assert comp.loss_source == eager.loss_source
    for B, T, seed, empty in BATCHES:
        b = random_batch(B, T, seed, empty_rows=empty)
        oc, gc, gvc = run(comp, b)
        oe, ge, gve = run(eager, b)
        torch.testing.assert_close(oc.loss, oe.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(gc).all()
        if comp.algorithm.uses_critic:
            torch.testing.assert_close(oc.value_loss, oe.value_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gvc, gve, rtol=1e-5, atol=1e-6)
        else:
            assert oc.value_loss is None and gvc is None
        assert oc.metrics.keys() == oe.metrics.keys()
        for k in oc.metrics:
            assert oc.metrics[k] == pytest.approx(oe.metrics[k], rel=1e-5, abs=1e-6), k
        if len(empty) == B:
            assert oc.loss.item() == 0.0 and torch.count_nonzero(gc) == 0
        elif empty:
            assert torch.count_nonzero(gc[list(empty)]) == 0


@pytest.mark.slow  # a torch.compile of scalerl (shared with the test above when both run)
@pytest.mark.compile
def test_compiled_denominator_for_micro_batches(compiled_algorithm, eager_algorithm):
    """scalerl (prompt_mean): two compiled micro-batches with the summed denominator = the whole."""
    comp, eager = compiled_algorithm("scalerl"), eager_algorithm("scalerl")
    b = random_batch(8, 16, 5, empty_rows=(1,))
    whole = eager.loss(b["logp"], b["old"], b["adv"], b["mask"], group_size=G).loss
    parts = [{k: v[:4] for k, v in b.items()}, {k: v[4:] for k, v in b.items()}]
    den = sum(comp.denominator(p["mask"], G) for p in parts)
    total = sum(comp.loss(p["logp"], p["old"], p["adv"], p["mask"], group_size=G, denominator=den).loss
                for p in parts)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_rldsl_compile_0_gives_eager(monkeypatch, value):
    monkeypatch.setenv("RLDSL_COMPILE", value)
    fn = rldsl.compile(rldsl.load("grpo"))
    assert not fn.compiled
    assert fn._loss is fn.eager_loss


def test_compile_false_is_eager_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("RLDSL_COMPILE", "1")
    fn = rldsl.compile(rldsl.load("grpo"), compile=False)
    assert not fn.compiled and fn._loss is fn.eager_loss
