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


# ---------------------------------------------------------------- the critic's own aggregation


def _value_terms(b, c: float) -> list[list[float]]:
    M, V, VO, R = lists(b["mask"]), lists(b["values"]), lists(b["old_values"]), lists(b["returns"])
    return [[verl_value_loss(V[i][t], VO[i][t], R[i][t], c)[0] if M[i][t] else 0.0
             for t in range(len(M[0]))] for i in range(len(M))]


@pytest.mark.parametrize(("critic_agg", "policy_agg"), [
    ("token_mean", "seq_mean_token_mean"),   # the ppo library spec: verl critic default vs GRPO-style policy
    ("seq_mean_token_mean", "token_mean"),
    ("seq_mean_token_sum", "token_mean"),
    ("prompt_mean", "seq_mean_token_mean"),
])
def test_value_loss_uses_the_critics_own_aggregation(critic_agg, policy_agg):
    agg = "" if critic_agg == "token_mean" else f", aggregation={critic_agg}"
    fn = spec_fn(f"baseline gae\ncritic value(clip=0.2{agg})\ntrust_region clip\naggregation {policy_agg}")
    b = random_batch(6, 5, 3, empty_rows=(4,))
    out = fn.loss(b["logp"], b["old"], b["adv"], b["mask"], values=b["values"], returns=b["returns"],
                  old_values=b["old_values"], group_size=2)
    L = _value_terms(b, 0.2)
    M = lists(b["mask"])
    lengths = [sum(row) for row in M]
    rows = [i for i in range(6) if lengths[i] > 0]
    if critic_agg == "token_mean":  # verl critic loss_agg_mode="token-mean"
        want = sum(map(sum, L)) / sum(lengths)
    elif critic_agg == "seq_mean_token_mean":
        want = sum(sum(L[i]) / lengths[i] for i in rows) / len(rows)
    elif critic_agg == "seq_mean_token_sum":
        want = sum(sum(L[i]) for i in rows) / len(rows)
    else:  # prompt_mean, G = 2
        groups = [(0, 1), (2, 3), (4, 5)]
        want = sum(sum(sum(L[i]) for i in g) / sum(lengths[i] for i in g) for g in groups) / 3
    assert out.value_loss.item() == pytest.approx(want, rel=1e-5)


def test_ppo_library_value_loss_is_token_mean_while_the_policy_is_not(eager_algorithm):
    fn = eager_algorithm("ppo")
    assert fn.algorithm["aggregation"].component == "seq_mean_token_mean"
    assert fn.algorithm["critic"].params["aggregation"] == "token_mean"
    b = random_batch(5, 6, 1, empty_rows=(2,))
    out = fn.loss(b["logp"], b["old"], b["adv"], b["mask"], values=b["values"], returns=b["returns"],
                  old_values=b["old_values"])
    assert out.value_loss.item() == pytest.approx(sum(map(sum, _value_terms(b, 0.5))) / b["mask"].sum().item(),
                                                  rel=1e-5)


def test_value_denominator_makes_micro_batches_exact():
    fn = spec_fn("baseline gae\ncritic value(clip=0.2)\ntrust_region clip\naggregation seq_mean_token_mean")
    b = random_batch(8, 5, 7, empty_rows=(1,))
    whole = fn.loss(b["logp"], b["old"], b["adv"], b["mask"], values=b["values"], returns=b["returns"],
                    old_values=b["old_values"]).value_loss
    parts = [{k: v[:3] for k, v in b.items()}, {k: v[3:] for k, v in b.items()}]
    den = sum(fn.denominator(p["mask"]) for p in parts)
    vden = sum(fn.value_denominator(p["mask"]) for p in parts)
    assert vden.item() == b["mask"].sum().item()  # token_mean counts tokens
    split = [fn.loss(p["logp"], p["old"], p["adv"], p["mask"], values=p["values"], returns=p["returns"],
                     old_values=p["old_values"], denominator=den, value_denominator=vden).value_loss
             for p in parts]
    assert sum(v.item() for v in split) == pytest.approx(whole.item(), rel=1e-6)
    # without value_denominator each part divides by its own count: not the whole-batch loss
    alone = [fn.loss(p["logp"], p["old"], p["adv"], p["mask"], values=p["values"], returns=p["returns"],
                     old_values=p["old_values"], denominator=den).value_loss for p in parts]
    assert sum(v.item() for v in alone) != pytest.approx(whole.item(), rel=1e-3)


def test_value_loss_shares_the_policy_denominator_when_it_aggregates_the_same_way():
    fn = spec_fn("baseline gae\ncritic value(clip=0.2)\ntrust_region clip\naggregation token_mean")
    b = random_batch(4, 5, 2)
    half = {k: v[:2] for k, v in b.items()}
    den = b["mask"].sum()
    out = fn.loss(half["logp"], half["old"], half["adv"], half["mask"], values=half["values"],
                  returns=half["returns"], old_values=half["old_values"], denominator=den)
    assert out.value_loss.item() == pytest.approx(sum(map(sum, _value_terms(half, 0.2))) / den.item(), rel=1e-5)
    assert "denominator" in fn.loss_source.split("value_loss =")[0].split("v_weights")[1]


def test_value_denominator_needs_a_critic():
    with pytest.raises(ValueError, match="has no critic"):
        spec_fn("baseline group_mean").value_denominator(torch.ones(2, 3))


def test_critic_aggregations_are_registered_and_parameter_free():
    from rldsl import registry
    for name in cr.VALUE_AGGREGATIONS:
        comp = registry.get("aggregation", name)
        assert all(not p.required for p in comp.params.values()), name
    assert registry.get("critic", "value").params["aggregation"].default == "token_mean"
