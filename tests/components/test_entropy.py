"""entropy slot: verl ppo_loss = pg_loss - entropy_coeff * agg_loss(H) (same aggregation)."""
from __future__ import annotations

import pytest
import torch

from component_refs import assert_close, lists, random_batch, ref_aggregate, spec_fn
from rldsl.components import entropy as en


def test_bonus_and_none_values():
    h = torch.tensor([[0.5, 2.0]])
    assert lists(en.bonus(h, coef=0.01)) == [[pytest.approx(-0.005), pytest.approx(-0.02)]]
    assert torch.count_nonzero(en.none(h)) == 0


@pytest.mark.parametrize("agg,mode", [("token_mean", "token_mean"),
                                      ("seq_mean_token_mean", "seq_mean_token_mean")])
def test_bonus_equals_verl_pg_minus_coef_times_aggregated_entropy(agg, mode):
    with_h = spec_fn(f"entropy bonus(coef=0.01)\ntrust_region clip\naggregation {agg}")
    without = spec_fn(f"trust_region clip\naggregation {agg}")
    b = random_batch(5, 6, 0, empty_rows=(3,))
    lp = b["logp"].clone().requires_grad_(True)
    out = with_h.loss(lp, b["old"], b["adv"], b["mask"], entropy=b["ent"])
    (g,) = torch.autograd.grad(out.loss, lp)
    base = without.loss(lp, b["old"], b["adv"], b["mask"], entropy=b["ent"])
    (g0,) = torch.autograd.grad(base.loss, lp)
    h_agg = ref_aggregate(lists(b["ent"]), lists(b["mask"]), mode)
    assert out.loss.item() == pytest.approx(base.loss.item() - 0.01 * h_agg, rel=1e-5)
    assert_close(g, g0)  # the entropy is an input here: no gradient to logp
    # the entropy metric is a token mean, whatever the aggregation
    assert out.metrics["entropy"] == pytest.approx(ref_aggregate(lists(b["ent"]), lists(b["mask"]), "token_mean"))
    with pytest.raises(ValueError, match="entropy"):
        with_h.loss(lp, b["old"], b["adv"], b["mask"])
