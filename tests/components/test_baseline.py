"""baseline slot: every component against plain-loop references of verl's and TRL's estimators
(singleton groups, masked tokens, GAE recursion)."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import adv_batch, assert_close, lists, ref_masked_whiten, right_padded_mask, spec_fn
from rldsl.components import baseline as bl

NAN = float("nan")


def first_token(adv: torch.Tensor) -> list[float]:
    return lists(adv[:, 0])


# ---------------------------------------------------------------- references (loops)


def ref_group_mean(r: list[float], G: int) -> list[float]:
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        mu = sum(grp) / G
        out += [x - mu for x in grp]
    return out


def ref_leave_one_out(r: list[float], G: int, singleton: str = "zero") -> list[float]:
    """RLOO: r_i minus the mean of the other G-1 rewards (NaN rewards are not there); a sample
    with no scorable other gets 0 (TRL) or keeps r (verl rloo, singleton="reward")."""
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        for i, x in enumerate(grp):
            others = [y for j, y in enumerate(grp) if j != i and math.isfinite(y)]
            alone = x if singleton == "reward" else 0.0
            out.append(x - sum(others) / len(others) if others else alone)
    return out


def ref_gae(rew, val, mask, gamma, lam):
    """verl compute_gae_advantage_return, as written there (masked tokens carry V and A through)."""
    B, T = len(rew), len(rew[0])
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        nextvalues, lastgaelam = 0.0, 0.0
        for t in reversed(range(T)):
            delta = rew[i][t] + gamma * nextvalues - val[i][t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = val[i][t] * mask[i][t] + (1 - mask[i][t]) * nextvalues
            lastgaelam = lastgaelam_ * mask[i][t] + (1 - mask[i][t]) * lastgaelam
            adv[i][t] = lastgaelam
    returns = [[adv[i][t] + val[i][t] for t in range(T)] for i in range(B)]
    return adv, returns


# ---------------------------------------------------------------- none / batch_mean / ema


def test_none_is_the_reward_on_every_response_token():
    mask = [[1, 1, 0], [1, 0, 0]]
    adv, ret = bl.none(adv_batch([2.0, -1.0], 1, mask=mask))
    assert lists(adv) == [[2, 2, 0], [-1, 0, 0]]
    assert torch.equal(adv, ret)  # outcome baselines: returns == advantages (verl)


def test_batch_mean_hand_numbers():
    adv, _ = bl.batch_mean(adv_batch([1.0, 2.0, 3.0, 6.0], 2))  # mean 3
    assert first_token(adv) == [-2.0, -1.0, 0.0, 3.0]


def test_batch_mean_constant_batch_is_exactly_zero():
    adv, _ = bl.batch_mean(adv_batch([0.1] * 7, 7))
    assert torch.count_nonzero(adv) == 0


def test_ema_over_three_batches_and_state_dict_round_trip():
    fn = spec_fn("baseline ema(decay=0.9)\nobjective reinforce\naggregation seq_mean_token_sum")
    m = torch.ones(2, 2)
    # batch 1: b_0 = mean(r) = 2 -> A = r - 2; b_1 = 0.9*2 + 0.1*2 = 2
    assert first_token(fn.advantages(torch.tensor([1.0, 3.0]), 1, m)) == pytest.approx([-1, 1])
    # batch 2: A = r - 2; b_2 = 0.9*2 + 0.1*5 = 2.3
    assert first_token(fn.advantages(torch.tensor([4.0, 6.0]), 1, m)) == pytest.approx([2, 4])
    saved = fn.state_dict()
    assert float(saved["ema_baseline"]) == pytest.approx(2.3)
    # batch 3 on a fresh object restored from the checkpoint: A = r - 2.3; b_3 = 0.9*2.3 + 0.1*0.5
    fresh = spec_fn("baseline ema(decay=0.9)\nobjective reinforce\naggregation seq_mean_token_sum")
    fresh.load_state_dict(saved)
    a3 = first_token(fresh.advantages(torch.tensor([0.0, 1.0]), 1, m))
    assert a3 == pytest.approx([-2.3, -1.3])
    assert float(fresh.state_dict()["ema_baseline"]) == pytest.approx(2.12)
    # the original object continues identically; state_dict returned a copy
    saved["ema_baseline"].fill_(100.0)
    assert first_token(fn.advantages(torch.tensor([0.0, 1.0]), 1, m)) == pytest.approx(a3)


# ---------------------------------------------------------------- group_mean


def test_group_mean_hand_numbers_and_reference():
    r = [1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 4.0, 0.0]
    adv, ret = bl.group_mean(adv_batch(r, 4))
    assert first_token(adv) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 2.0, 1.0, -3.0])
    assert first_token(adv) == pytest.approx(ref_group_mean(r, 4))
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3, -2.2, 5.9, 1.0, 0.0])
@pytest.mark.parametrize("G", [3, 7, 8, 16])
def test_group_mean_zero_variance_group_is_exactly_zero(value, G):
    # float32 mean of 8 x 0.1 is not 0.1: a naive r - mean leaves ~1e-8, which a std
    # normaliser with eps 1e-6 turns into ~1e-2.
    r = [value] * G + [float(i % 2) for i in range(G)]
    adv, _ = bl.group_mean(adv_batch(r, G))
    assert torch.count_nonzero(adv[:G]) == 0
    assert torch.count_nonzero(adv[G:]) > 0


def test_group_mean_singleton_group_gives_zero():
    adv, _ = bl.group_mean(adv_batch([0.3, 1.0, -2.0], 1))
    assert torch.count_nonzero(adv) == 0


def test_group_mean_zero_on_padding():
    mask = right_padded_mask([3, 1, 0, 2], 3)
    adv, _ = bl.group_mean(adv_batch([1.0, 0.0, 2.0, 5.0], 2, mask=mask))
    assert_close(adv, [[0.5] * 3, [-0.5, 0, 0], [0, 0, 0], [1.5, 1.5, 0]])


# ---------------------------------------------------------------- leave_one_out


def test_leave_one_out_hand_numbers_and_reference():
    r = [1.0, 0.0, 0.0, 1.0]
    adv, _ = bl.leave_one_out(adv_batch(r, 4), singleton="zero")
    # i=0: 1 - (0+0+1)/3 = 2/3 ; i=1: 0 - (1+0+1)/3 = -2/3
    assert first_token(adv) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    r = [0.2, 1.5, -0.7, 3.0, 0.0, 0.1]
    adv, _ = bl.leave_one_out(adv_batch(r, 3), singleton="zero")
    assert first_token(adv) == pytest.approx(ref_leave_one_out(r, 3))
    # verl's closed form r*K/(K-1) - mean*K/(K-1)
    K = 3
    verl = [x * K / (K - 1) - sum(r[(i // K) * K:(i // K + 1) * K]) / K * K / (K - 1) for i, x in enumerate(r)]
    assert first_token(adv) == pytest.approx(verl)


def test_leave_one_out_pair_is_the_difference():
    adv, _ = bl.leave_one_out(adv_batch([3.0, 1.0], 2), singleton="zero")
    assert first_token(adv) == [2.0, -2.0]


def test_leave_one_out_singleton_is_zero_like_trl_or_the_reward_like_verl():
    adv, _ = bl.leave_one_out(adv_batch([0.3, 1.0, -2.0], 1), singleton="zero")
    assert first_token(adv) == [0.0, 0.0, 0.0]  # TRL RLOOTrainer: num_generations == 1 -> A = 0
    adv, _ = bl.leave_one_out(adv_batch([0.3, 1.0, -2.0], 1), singleton="reward")
    assert first_token(adv) == pytest.approx([0.3, 1.0, -2.0])  # verl compute_rloo_outcome_advantage


@pytest.mark.parametrize("singleton", ["zero", "reward"])
def test_leave_one_out_one_scorable_sample_in_a_group(singleton):
    """[NaN, 0.7, NaN] has one scorable sample: no baseline for it (the default gives A = 0)."""
    src = "baseline leave_one_out" + ("(singleton=reward)" if singleton == "reward" else "")
    fn = spec_fn(src + "\nobjective reinforce")
    r = [NAN, 0.7, NAN, 1.0, 0.0, 0.5]
    est = fn.estimate(torch.tensor(r), 3, torch.ones(6, 2))
    want = ref_leave_one_out(r, 3, singleton)
    assert first_token(est.advantages)[1] == pytest.approx(want[1])
    assert first_token(est.advantages)[3:] == pytest.approx(want[3:])  # [1 - .25, 0 - .75, .5 - .5]
    assert want[1] == (0.7 if singleton == "reward" else 0.0)
    assert lists(est.mask.sum(-1)) == [0.0, 2.0, 0.0, 2.0, 2.0, 2.0]  # failed rewards leave the loss


def test_leave_one_out_default_is_trl_and_the_spec_names_it():
    from rldsl import registry
    assert registry.get("baseline", "leave_one_out").params["singleton"].default == "zero"
    assert spec_fn("baseline leave_one_out(singleton=reward)").algorithm["baseline"].params == {
        "singleton": "reward", "group_by": None}  # every parameter known: group_by not given


def test_leave_one_out_zero_variance_group_is_exactly_zero():
    adv, _ = bl.leave_one_out(adv_batch([0.1] * 8, 8), singleton="zero")
    assert torch.count_nonzero(adv) == 0


# ---------------------------------------------------------------- gae


def test_gae_hand_numbers_gamma_lambda_one():
    # gamma = lam = 1: A_t = R - V_t (the return-to-go minus the value)
    batch = adv_batch([1.0], 1, mask=[[1, 1, 1]], values=[[0.5, 0.6, 0.7]], token_rewards=[[0, 0, 1]])
    adv, ret = bl.gae(batch, gamma=1.0, lam=1.0)
    assert_close(adv, [[0.5, 0.4, 0.3]])
    assert_close(ret, [[1.0, 1.0, 1.0]])


def test_gae_skips_masked_tokens_in_the_middle_hand_numbers():
    # t=2: delta = 1 - 0.7 = 0.3; t=1 masked (observation): V and A pass through;
    # t=0: delta = 0 + 0.9*0.7 - 0.5 = 0.13; A_0 = 0.13 + 0.9*0.8*0.3 = 0.346
    batch = adv_batch([1.0], 1, mask=[[1, 0, 1]], values=[[0.5, 0.6, 0.7]], token_rewards=[[0, 0, 1]])
    adv, ret = bl.gae(batch, gamma=0.9, lam=0.8)
    assert_close(adv, [[0.346, 0.0, 0.3]])
    assert_close(ret, [[0.846, 0.0, 1.0]])


def test_gae_matches_verl_recursion_on_random_batch():
    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    mask = (torch.rand(B, T, generator=g) > 0.3).float()  # holes anywhere, as multi-turn masks
    mask[2] = 0  # fully masked row
    rew = torch.randn(B, T, generator=g) * mask
    val = torch.randn(B, T, generator=g)
    batch = adv_batch(torch.zeros(B), 1, mask=mask, values=val, token_rewards=rew)
    adv, ret = bl.gae(batch, gamma=0.95, lam=0.9)
    ref_a, ref_r = ref_gae(lists(rew), lists(val), lists(mask), 0.95, 0.9)
    m = lists(mask)
    want_a = [[a * mm for a, mm in zip(ra, rm)] for ra, rm in zip(ref_a, m)]
    want_r = [[a * mm for a, mm in zip(ra, rm)] for ra, rm in zip(ref_r, m)]
    assert_close(adv, want_a, atol=1e-5)
    assert_close(ret, want_r, atol=1e-5)
    assert torch.count_nonzero(adv[2]) == 0


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        bl.gae(adv_batch([1.0], 1), gamma=1.0, lam=1.0)


def test_ppo_estimate_whitens_gae_like_verl():
    """Library ppo: GAE (gamma 1, lam 0.95), then verl masked_whiten; returns = A + V unwhitened."""
    fn = spec_fn("baseline gae(gamma=1.0, lam=0.95)\nnormalizer whiten\ncritic value(clip=0.5)")
    mask = right_padded_mask([4, 2, 3], 4)
    val = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, -0.5, 9.0, 9.0], [0.0, 0.3, 0.2, 9.0]])
    r = torch.tensor([1.0, 0.0, 2.0])
    est = fn.estimate(r, 1, mask, values=val)
    tok_r = [[0.0] * 4 for _ in range(3)]
    for i, L in enumerate([4, 2, 3]):
        tok_r[i][L - 1] = float(r[i])  # the sequence reward on the last response token
    a, ret = ref_gae(tok_r, lists(val), lists(mask), 1.0, 0.95)
    want = ref_masked_whiten(a, lists(mask))
    m = lists(mask)
    assert_close(est.advantages, [[w * mm for w, mm in zip(rw, rm)] for rw, rm in zip(want, m)], atol=1e-5)
    assert_close(est.returns, [[x * mm for x, mm in zip(rr, rm)] for rr, rm in zip(ret, m)])
