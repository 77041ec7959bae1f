"""Compiled == eager for the peers' components that no library spec puts together (the library
specs gspo ... vespo are covered by test_compiled_vs_eager.py): the straight-through KLs, abs, the
DRO objective, the product ratio under the soft gate and token_sum. Each spec is compiled once."""
from __future__ import annotations


import pytest
import torch

import rldsl
from peer_cases import loss_batch

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.compile,
    pytest.mark.slow,  # torch.compile of each spec: tens of seconds on a busy 2-core machine
]

SPECS = {
    "gate_product_abs_st_sum": "ratio product(clamp=20.0)\ntrust_region soft_gate(tau_pos=1.0, tau_neg=1.05)\n"
                               "kl abs(beta=0.1, where=loss, straight_through=true)\naggregation token_sum",
    "dro_k3_st_k1": "ratio token(clamp=80.0)\nobjective dro(beta=0.05)\n"
                    "kl k3(beta=0.1, where=loss, clamp=true, straight_through=true)\n"
                    "aggregation seq_mean_token_sum(count_empty=true)",
}


def _text(name: str) -> str:
    body = "\n".join("  " + line for line in SPECS[name].splitlines())
    return f'algorithm {name}\n  "compiled == eager"\n{body}\n'


@pytest.fixture()  # function scope: built after the compile marker is applied (rldsl caches the compiled losses)
def pairs():
    out = {}
    for name in SPECS:
        algo = rldsl.loads(_text(name), filename=f"{name}.rl")
        out[name] = (rldsl.compile(algo, compile=True), rldsl.compile(algo, compile=False))
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiled_equals_eager(pairs, name):
    comp, eager = pairs[name]
    assert comp.compiled and not eager.compiled
    for seed in (0, 1):  # float32, the runtime's dtype (another dtype would recompile)
        b = {k: v.float() for k, v in loss_batch(seed).items()}
        res = []
        for f in (comp, eager):
            lp = b["logp"].clone().requires_grad_(True)
            out = f.loss(lp, b["old"], b["adv"], b["mask"], ref_logprobs=b["ref"])
            (g,) = torch.autograd.grad(out.loss, lp)
            res.append((out, g))
        (oc, gc), (oe, ge) = res
        torch.testing.assert_close(oc.loss, oe.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(gc).all()
        for k in oe.metrics:
            assert oc.metrics[k] == pytest.approx(oe.metrics[k], rel=1e-5, abs=1e-6), k
