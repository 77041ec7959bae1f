"""normalizer slot against loop references: verl grpo (Bessel, +1e-6), TRL scale_rewards
(group +1e-4, batch), ROLL/Lite PPO batch std, MaxRL p-normalisation, verl masked_whiten."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import adv_batch, assert_close, lists, ref_masked_whiten, spec_fn
from rldsl.components import baseline as bl
from rldsl.components import normalizer as nz


def bessel_std(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def pop_std(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))


def ref_grpo(r: list[float], G: int, eps: float) -> list[float]:
    """verl compute_grpo_outcome_advantage / TRL scale_rewards="group": (r - mu_g)/(sigma_g + eps)."""
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        if G == 1:  # verl singleton: mean 0, std 1 (TRL would give NaN -> 0)
            out += [grp[0] / (1 + eps)]
            continue
        mu, sd = sum(grp) / G, bessel_std(grp)
        out += [(x - mu) / (sd + eps) for x in grp]
    return out


def ref_lite_ppo(r: list[float], G: int, eps: float) -> list[float]:
    """ROLL norm_mean_type=group, norm_std_type=batch: std of the raw rewards of the batch."""
    sd = bessel_std(r)
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        mu = sum(grp) / G
        out += [(x - mu) / (sd + eps) for x in grp]
    return out


def ref_maxrl(r: list[float], G: int, eps: float = 1e-6) -> list[float]:
    """tajwarfahim/maxrl compute_maxrl_outcome_advantage: (r - mu_g) / (mu_g + 1e-6)."""
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        mu = sum(grp) / G
        out += [(x - mu) / (mu + eps) for x in grp]
    return out


def normalize(name: str, r, G: int, baseline=bl.group_mean, mask=None, **params) -> torch.Tensor:
    batch = adv_batch(r, G, mask=mask)
    adv, _ = baseline(batch)
    return getattr(nz, name)(adv, batch, **params)


# ---------------------------------------------------------------- group_std


def test_group_std_hand_numbers():
    # group [1,0,0,1]: mean .5, Bessel var = 4*.25/3 = 1/3, std = 0.57735
    a = normalize("group_std", [1.0, 0.0, 0.0, 1.0], 4, eps=1e-6, unbiased=True)
    assert lists(a[:, 0]) == pytest.approx([0.866024, -0.866024, -0.866024, 0.866024], rel=1e-5)


def test_group_std_matches_verl_and_trl_eps():
    r = [0.3, 1.0, 0.0, 0.9, 0.2, 0.25, 0.2, 0.21]  # small std: the eps matters
    verl = normalize("group_std", r, 4, eps=1e-6, unbiased=True)
    trl = normalize("group_std", r, 4, eps=1e-4, unbiased=True)
    assert_close(verl[:, 0], ref_grpo(r, 4, 1e-6), rtol=1e-6)
    assert_close(trl[:, 0], ref_grpo(r, 4, 1e-4), rtol=1e-6)
    # the second group's std is ~0.024: the two conventions differ by ~0.4 %
    assert not torch.allclose(verl[4:], trl[4:], rtol=1e-3)


def test_group_std_population_variant():
    r = [1.0, 0.0, 0.0, 0.0]
    a = normalize("group_std", r, 4, eps=0.0, unbiased=False)
    mu, sd = 0.25, pop_std(r)
    assert lists(a[:, 0]) == pytest.approx([(x - mu) / sd for x in r])


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
def test_group_std_zero_variance_group_is_exactly_zero(value):
    a = normalize("group_std", [value] * 8 + [1, 0, 1, 0, 1, 0, 1, 1], 8, eps=1e-6, unbiased=True)
    assert torch.count_nonzero(a[:8]) == 0
    assert torch.isfinite(a).all()


def test_group_std_singleton_uses_std_one():
    # leave_one_out(singleton=reward) keeps r for a singleton; the std of one sample is taken
    # as 1 (verl's rule)
    a = normalize("group_std", [0.5, -2.0], 1, baseline=lambda b: bl.leave_one_out(b, singleton="reward"),
                  eps=1e-6, unbiased=True)
    assert lists(a[:, 0]) == pytest.approx([0.5 / (1 + 1e-6), -2.0 / (1 + 1e-6)])
    # with group_mean the numerator is 0: A = 0 and no NaN
    a = normalize("group_std", [0.5, -2.0], 1, eps=1e-6, unbiased=True)
    assert torch.count_nonzero(a) == 0


def test_grpo_library_advantages_equal_verl_grpo(eager_algorithm):
    fn = eager_algorithm("grpo")
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (16,), generator=g).float()
    r[:4] = 1.0  # an all-pass group
    mask = torch.ones(16, 5)
    mask[3, 2:] = 0
    adv = fn.advantages(r, 4, mask)
    want = ref_grpo(lists(r), 4, 1e-6)
    assert_close(adv, [[w * m for m in row] for w, row in zip(want, lists(mask))], rtol=1e-6)


# ---------------------------------------------------------------- batch_std


def test_batch_std_hand_numbers():
    # r = [1,0,1,1]: group means .5 and 1; batch std (Bessel) of raw rewards = 0.5
    a = normalize("batch_std", [1.0, 0.0, 1.0, 1.0], 2, eps=1e-6, unbiased=True)
    assert lists(a[:, 0]) == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0])


def test_batch_std_matches_roll_and_trl():
    r = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.3, 0.9, 0.6]
    roll = normalize("batch_std", r, 3, eps=1e-6, unbiased=True)
    trl = normalize("batch_std", r, 3, eps=1e-4, unbiased=True)
    assert_close(roll[:, 0], ref_lite_ppo(r, 3, 1e-6), rtol=1e-6)
    assert_close(trl[:, 0], ref_lite_ppo(r, 3, 1e-4), rtol=1e-6)
    assert torch.count_nonzero(roll[3:6]) == 0  # the all-pass group


def test_batch_std_constant_batch_gives_zero():
    a = normalize("batch_std", [0.1] * 8, 4, eps=1e-6, unbiased=True)
    assert torch.count_nonzero(a) == 0


# ---------------------------------------------------------------- success_rate (MaxRL)


def test_success_rate_hand_numbers():
    # p = 1/4: the success gets (1-p)/p = 3, failures -1 (up to the 1e-6)
    a = normalize("success_rate", [1.0, 0.0, 0.0, 0.0], 4, eps=1e-6)
    assert lists(a[:, 0]) == pytest.approx([0.75 / 0.250001, -0.25 / 0.250001,
                                            -0.25 / 0.250001, -0.25 / 0.250001], rel=1e-6)
    assert lists(a[:, 0]) == pytest.approx([3.0, -1.0, -1.0, -1.0], rel=1e-5)


def test_success_rate_matches_official_maxrl():
    r = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    a = normalize("success_rate", r, 4, eps=1e-6)
    assert_close(a[:, 0], ref_maxrl(r, 4), rtol=1e-6)


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_success_rate_all_fail_and_all_pass_give_zero(value):
    a = normalize("success_rate", [value] * 4 + [1, 0, 0, 1], 4, eps=1e-6)
    assert torch.count_nonzero(a[:4]) == 0
    assert torch.isfinite(a).all()


def test_maxrl_library_estimate(eager_algorithm):
    fn = eager_algorithm("maxrl")
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    adv = fn.advantages(r, 4, torch.ones(16, 2))[:, 0]
    assert_close(adv, ref_maxrl(lists(r), 4), rtol=1e-6)
    assert torch.count_nonzero(adv[4:12]) == 0


# ---------------------------------------------------------------- whiten (verl masked_whiten)


def test_whiten_matches_verl_masked_whiten():
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    mask[1] = 0
    vals = torch.randn(4, 6, generator=g) * mask
    batch = adv_batch(torch.zeros(4), 1, mask=mask)
    out = nz.whiten(vals, batch, eps=1e-8, shift_mean=True)
    want = ref_masked_whiten(lists(vals), lists(mask))
    assert_close(out, [[w * m for w, m in zip(rw, rm)] for rw, rm in zip(want, lists(mask))], atol=1e-5)
    # whitened tokens: mean 0, Bessel variance 1 (within 1e-8)
    n = mask.sum()
    assert float((out * mask).sum() / n) == pytest.approx(0.0, abs=1e-6)
    assert float(((out * mask) ** 2).sum() / (n - 1)) == pytest.approx(1.0, rel=1e-5)
    keep = nz.whiten(vals, batch, eps=1e-8, shift_mean=False)
    want = ref_masked_whiten(lists(vals), lists(mask), shift_mean=False)
    assert_close(keep, [[w * m for w, m in zip(rw, rm)] for rw, rm in zip(want, lists(mask))], atol=1e-5)


def test_whiten_hand_numbers():
    # tokens 1, 2, 3 (one padding): mean 2, Bessel var 1 -> -1, 0, 1 (/sqrt(1 + 1e-8))
    batch = adv_batch(torch.zeros(1), 1, mask=[[1, 1, 1, 0]])
    out = nz.whiten(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), batch, eps=1e-8, shift_mean=True)
    assert_close(out, [[-1.0, 0.0, 1.0, 0.0]])


def test_whiten_fewer_than_two_tokens_is_unchanged():
    batch = adv_batch(torch.zeros(2), 1, mask=[[1, 0], [0, 0]])
    x = torch.tensor([[0.7, 0.0], [0.0, 0.0]])
    assert torch.equal(nz.whiten(x, batch, eps=1e-8, shift_mean=True), x)


def test_normalizer_none_is_identity():
    fn = spec_fn("baseline group_mean\nnormalizer none")
    adv = fn.advantages(torch.tensor([3.0, 1.0]), 2, torch.ones(2, 2))
    assert_close(adv, [[1.0, 1.0], [-1.0, -1.0]])
