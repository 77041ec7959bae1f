"""`entropy adaptive`: TRL GRPOTrainer's use_adaptive_entropy, against a transcription of its
controller (coefficient applied only while the last step's entropy is at or below the target,
moved by delta within [min, max] after every optimizer step, first step H = +inf)."""
from __future__ import annotations

import pytest
import torch

from component_refs import spec_fn

SPEC = """ratio token(clamp=80.0)
trust_region clip(low=0.2, high=0.2)
entropy adaptive(init={init}, min={lo}, max={hi}, delta={delta}, target={target})
aggregation token_mean"""


class TrlAdaptiveEntropy:
    """TRL GRPOTrainer: __init__ (entropy_coef, _last_world_entropy = inf) and _compute_loss's
    adaptive block, one optimizer step = the micro-batches of one accumulation window."""

    def __init__(self, entropy_coef, entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target):
        self.entropy_coef = entropy_coef
        self.args = dict(min=entropy_coef_min, max=entropy_coef_max, delta=entropy_coef_delta,
                         target=entropy_target)
        self._last_world_entropy = float("inf")

    def optimizer_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        a = self.args
        apply_coef = self.entropy_coef if self._last_world_entropy <= a["target"] else 0.0
        stats = None
        for entropies, mask in micro:
            s = torch.stack([(entropies * mask).sum(), mask.sum()])
            stats = s if stats is None else stats + s
        world_entropy = (stats[0] / stats[1].clamp(min=1.0)).item()
        if world_entropy <= a["target"]:
            self.entropy_coef = min(self.entropy_coef + a["delta"], a["max"])
        else:
            self.entropy_coef = max(self.entropy_coef - a["delta"], a["min"])
        self._last_world_entropy = world_entropy
        return apply_coef


@pytest.mark.parametrize("seed", range(4))
def test_the_coefficient_sequence_equals_trl(seed):
    g = torch.Generator().manual_seed(seed)
    init, lo, hi, delta, target = 0.02, 0.005, 0.04, 0.01, 1.0
    fn = spec_fn(SPEC.format(init=init, lo=lo, hi=hi, delta=delta, target=target))
    ref = TrlAdaptiveEntropy(init, lo, hi, delta, target)
    applied, moved = [], 0
    for _ in range(30):  # entropies straddle the target: both branches and both bounds are hit
        micro = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            ent = torch.rand(3, 5, generator=g, dtype=torch.float64) * 2.2
            mask = (torch.rand(3, 5, generator=g) > 0.3).double()
            micro.append((ent, mask))
        want = ref.optimizer_step(micro)
        got = float(fn.entropy_coef())
        assert got == pytest.approx(want, abs=1e-15)
        applied.append(got)
        ent_sum = sum(float((e * m).sum()) for e, m in micro)
        n = sum(float(m.sum()) for _, m in micro)
        new = fn.update_entropy_coef(ent_sum / max(n, 1.0))["entropy_coef"]
        assert new == pytest.approx(ref.entropy_coef, abs=1e-15)
        moved += new in (lo, hi)
    assert applied[0] == 0.0  # H_{-1} = +inf: no bonus on the first step, as TRL
    assert 0.0 in applied[1:] and any(a > 0 for a in applied) and moved > 0


@pytest.mark.compile
def test_the_loss_term_is_trls_token_mean_bonus_and_a_new_coefficient_does_not_recompile():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = -torch.rand(B, T, generator=g)
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    ent = torch.rand(B, T, generator=g) * 3
    base = spec_fn("ratio token(clamp=80.0)\ntrust_region clip(low=0.2, high=0.2)\naggregation token_mean")
    eager = spec_fn(SPEC.format(init=0.1, lo=0.0, hi=1.0, delta=0.005, target=0.2))
    compiled = spec_fn(SPEC.format(init=0.1, lo=0.0, hi=1.0, delta=0.005, target=0.2), name="c", compile=True)
    pg = base.loss(lp, old, adv, mask).loss
    h = (ent * mask).sum() / mask.sum()  # TRL: (entropies * mask).sum() / mask.sum(), one accumulation step
    for c in (0.0, 0.25, 0.7):
        want = pg - c * h
        got = eager.loss(lp, old, adv, mask, entropy=ent, entropy_coef=c).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled.loss(lp, old, adv, mask, entropy=ent, entropy_coef=torch.tensor(c)).loss,
                                   got, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="entropy_coef="):
        eager.loss(lp, old, adv, mask, entropy=ent)


def test_state_round_trips_through_state_dict():
    spec = SPEC.format(init=0.0, lo=0.0, hi=0.1, delta=0.01, target=1.0)
    a, b = spec_fn(spec), spec_fn(spec, name="b")
    for h in (0.5, 2.0, 0.4):  # coef 0.01, 0.0, 0.01; the last entropy is below the target
        a.update_entropy_coef(h)
    b.load_state_dict(a.state_dict())
    assert float(b.entropy_coef()) == float(a.entropy_coef()) == pytest.approx(0.01)
    assert b.update_entropy_coef(0.1) == a.update_entropy_coef(0.1)
    assert spec_fn("entropy bonus(coef=0.1)", name="s").entropy_coef() is None
