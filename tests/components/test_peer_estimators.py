"""verl 0.9.1 adv_estimator and TRL 1.16 scale_rewards options written as specs
(peer_cases.ADV_CASES) against transcriptions of the peers' code, through ``estimate()`` (float32)
on batches with singleton groups, zero-variance and all-zero groups, ties and an empty row; and
the new baselines called directly in float64 where exactness is the point."""
from __future__ import annotations

import pytest
import torch

import peer_refs as R
from peer_cases import ADV_CASES, estimate_kwargs, fn_for, reward_batch, run_adv, token_level_rewards
from rldsl.components import baseline as bl
from rldsl.components import normalizer as nm
from rldsl.ops import AdvantageBatch


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ADV_CASES, ids=lambda c: c.name)
def test_advantages_equal_the_peer(case, seed):
    for G in case.group_sizes:
        b = reward_batch(seed, G)
        ours, ref = run_adv(case, b)
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def f64_batch(r, G, mask, valid=None, token_rewards=None) -> AdvantageBatch:
    r = torch.as_tensor(r, dtype=torch.float64)
    mask = torch.as_tensor(mask, dtype=torch.float64)
    tr = torch.zeros_like(mask) if token_rewards is None else torch.as_tensor(token_rewards, dtype=torch.float64)
    return AdvantageBatch(rewards=r, raw_rewards=r, token_rewards=tr, mask=mask, group_size=G,
                          valid=None if valid is None else torch.as_tensor(valid))


def _rand(seed, G, P=5, T=7):
    g = torch.Generator().manual_seed(seed)
    B = P * G
    r = torch.randn(B, generator=g, dtype=torch.float64)
    r[:G] = 0.3  # a zero-variance group
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).double()
    return r, mask, [i // G for i in range(B)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("G", [1, 3, 4])
def test_new_baselines_in_float64(seed, G):
    """length_weighted_mean, leave_one_out(singleton=zero), group_mean(singleton=reward),
    leave_one_out_max and nonzero_rate to 1e-12 of verl's loops."""
    r, mask, idx = _rand(seed, G)
    b = f64_batch(r, G, mask)
    tlr = token_level_rewards(r, mask)
    cases = [(bl.length_weighted_mean(b)[0], R.verl_opo(tlr, mask, idx)),
             (bl.leave_one_out(b, singleton="zero")[0], R.verl_rloo_vectorized(tlr, mask, idx)),
             (bl.leave_one_out(b, singleton="reward")[0], R.verl_rloo(tlr, mask, idx)),
             (bl.group_mean(b, singleton="reward")[0], R.verl_grpo(tlr, mask, idx, norm_adv_by_std_in_grpo=False)),
             (nm.nonzero_rate(bl.group_mean(b, singleton="reward")[0], b, f_norm=1.5),
              R.verl_gpg(tlr, mask, idx, f_norm=1.5))]
    if G > 1:
        cases.append((bl.leave_one_out_max(b)[0], R.verl_grpo_passk(tlr, mask, idx, norm_adv_by_std_in_grpo=False)))
    for ours, ref in cases:
        torch.testing.assert_close(ours * mask, ref * mask, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_return_to_go_in_float64_with_holes(gamma):
    """Masked positions inside a row (observation tokens) are skipped, as verl's loop skips them."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    tr = torch.randn(4, 6, generator=g, dtype=torch.float64)  # rewards on masked tokens are dropped
    b = f64_batch(torch.zeros(4), 1, mask, token_rewards=tr)
    adv, ret = bl.return_to_go(b, gamma=gamma)
    want_ret = torch.zeros_like(tr)  # verl's loop, before its whitening
    running = torch.zeros(4, dtype=torch.float64)
    for t in reversed(range(6)):
        new = tr[:, t] + gamma * running
        want_ret[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    torch.testing.assert_close(adv, want_ret, rtol=0, atol=1e-15)
    torch.testing.assert_close(ret, want_ret, rtol=0, atol=1e-15)
    # by hand, row 0 with gamma: t=3 -> r3; t=1 -> r1 + g r3; t=0 -> r0 + g (r1 + g r3)
    r0 = tr[0]
    assert adv[0, 0].item() == pytest.approx((r0[0] + gamma * (r0[1] + gamma * r0[3])).item(), abs=1e-14)


def test_leave_one_out_max_edges():
    mask = torch.ones(8, 2, dtype=torch.float64)
    b = f64_batch([1, 0, 1, 0.5, 0.2, 0.9, 0.1, 0.9], 4, mask)
    a = bl.leave_one_out_max(b)[0][:, 0]
    # group 0 = (1, 0, 1, 0.5) and group 1 = (0.2, 0.9, 0.1, 0.9): ties for the best -> all 0
    assert a.tolist() == [0.0] * 8
    b = f64_batch([1, 0, 0.5, 0.25], 4, torch.ones(4, 2))
    assert bl.leave_one_out_max(b)[0][:, 1].tolist() == [0.5, 0.0, 0.0, 0.0]
    # a failed reward is never the best, and one scorable sample gives 0
    b = f64_batch([5.0, 1.0, 0.5, 0.25], 4, torch.ones(4, 2), valid=[False, True, True, True])
    assert bl.leave_one_out_max(b)[0][:, 0].tolist() == [0.0, 0.5, 0.0, 0.0]
    b = f64_batch([5.0, 1.0], 2, torch.ones(2, 2), valid=[False, True])
    assert bl.leave_one_out_max(b)[0].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        bl.leave_one_out_max(f64_batch([1.0, 0.0], 1, torch.ones(2, 2)))


def test_length_weighted_mean_edges():
    # an all-empty group: baseline 0, no NaN (verl divides 0 by 0); a constant group: exactly 0
    mask = torch.tensor([[0, 0], [0, 0], [1, 1], [1, 0]], dtype=torch.float64)
    b = f64_batch([1.0, 2.0, 0.1, 0.1], 2, mask)
    a = bl.length_weighted_mean(b)[0]
    assert torch.isfinite(a).all() and a.abs().sum().item() == 0.0
    # by hand: lengths 3 and 1, rewards 1 and 0 -> b = 3/4 -> A = 1/4, -3/4
    b = f64_batch([1.0, 0.0], 2, torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64))
    assert bl.length_weighted_mean(b)[0][:, 0].tolist() == [0.25, -0.75]


def test_nonzero_rate_by_hand_and_without_any_reward():
    b = f64_batch([1.0, 0.0, 0.0, 0.0], 2, torch.ones(4, 1))
    adv = torch.ones(4, 1, dtype=torch.float64)
    assert nm.nonzero_rate(adv, b, f_norm=1.0)[:, 0].tolist() == [4.0] * 4  # B / #nonzero = 4 / 1
    b = f64_batch([0.0, 0.0], 2, torch.ones(2, 1))
    assert nm.nonzero_rate(torch.ones(2, 1, dtype=torch.float64), b, f_norm=2.0)[:, 0].tolist() == [1.0, 1.0]


def test_singleton_conventions_through_estimate():
    """G = 1: TRL (and the defaults) give 0; verl grpo gives r / (1 + 1e-6); verl rloo r;
    rloo_vectorized 0."""
    from component_refs import spec_fn
    r, m = torch.tensor([0.5, -1.0, 2.0]), torch.ones(3, 2)
    got = {spec: spec_fn(spec).estimate(r, 1, m).advantages[:, 0].tolist() for spec in (
        "baseline group_mean\nnormalizer group_std(eps=1e-6)",
        "baseline group_mean(singleton=reward)\nnormalizer group_std(eps=1e-6)",
        "baseline leave_one_out(singleton=reward)", "baseline leave_one_out")}
    vals = list(got.values())
    assert vals[0] == [0.0, 0.0, 0.0]
    assert vals[1] == pytest.approx([x / (1 + 1e-6) for x in r.tolist()], rel=1e-6)
    assert vals[2] == r.tolist() and vals[3] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("case", [c for c in ADV_CASES if c.peer == "verl"], ids=lambda c: c.name)
def test_a_failed_reward_leaves_no_nan(case):
    """A reward that failed (NaN) leaves every advantage finite and its own row out of the loss."""
    b = reward_batch(7, 4)
    b["r"] = b["r"].clone()
    b["r"][5] = float("nan")
    est = fn_for(case.spec).estimate(b["r"], 4, b["mask"], **estimate_kwargs(case, b))
    assert torch.isfinite(est.advantages).all() and torch.isfinite(est.returns).all()
    assert est.mask[5].sum() == 0 and est.advantages[5].abs().sum() == 0


def test_remax_needs_the_greedy_reward_and_survives_a_failed_one():
    """baseline greedy_reward: estimate() without reward_baselines= names it; a NaN greedy
    reward (its reward function failed) gives A = 0 on that prompt's rows, others untouched."""
    b = reward_batch(3, 4)
    fn = fn_for("baseline greedy_reward")
    with pytest.raises(ValueError, match="reward_baselines="):
        fn.estimate(b["r"], 4, b["mask"])
    with pytest.raises(ValueError, match=r"reward_baselines must be \[B\]"):
        fn.estimate(b["r"], 4, b["mask"], reward_baselines=b["greedy"][:4])
    greedy = b["greedy"].clone()
    greedy[4:8] = float("nan")
    est = fn.estimate(b["r"], 4, b["mask"], reward_baselines=greedy)
    assert torch.isfinite(est.advantages).all()
    assert est.advantages[4:8].abs().sum() == 0
    m = b["mask"].double()
    ref = R.verl_remax(token_level_rewards(b["r"].double(), m), b["greedy"].double(), m)[0]
    keep = torch.ones(16, dtype=torch.bool)
    keep[4:8] = False
    torch.testing.assert_close(est.advantages.double()[keep], ref[keep], rtol=0, atol=1e-6)


OTB = "baseline optimal_token"


def test_optimal_token_baseline_needs_its_inputs():
    """estimate() without old_logprobs= / sum_pi_squared= names them; a wrong shape is told."""
    b = reward_batch(3, 4)
    fn = fn_for(OTB)
    with pytest.raises(ValueError, match="sum_pi_squared="):
        fn.estimate(b["r"], 4, b["mask"], old_logprobs=b["old"])
    with pytest.raises(ValueError, match="old_logprobs="):
        fn.estimate(b["r"], 4, b["mask"], sum_pi_squared=b["spp"])
    with pytest.raises(ValueError, match=r"sum_pi_squared must be \[B, T\]"):
        fn.estimate(b["r"], 4, b["mask"], old_logprobs=b["old"], sum_pi_squared=b["spp"][:, :3])


@pytest.mark.parametrize("align", ["position", "response_token"])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline_multi_turn_holes(align, zero_tail):
    """Masks with holes (tool outputs between turns), empty rows, a group with one non-empty row,
    a strictly longest row and tied longest rows: both verl variants to 1e-5, NaN-free."""
    g = torch.Generator().manual_seed(11)
    G, P, T = 4, 4, 14
    B = G * P
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    mask[:, 0] = 1.0
    mask[2] = 0.0  # an empty row
    mask[4:7] = 0.0  # group 1: one non-empty row
    mask[8:12, 9:] = 0.0
    mask[8, 9:] = 1.0  # group 2: a strictly longest row
    mask[12:16] = mask[12]  # group 3: tied lengths
    r = torch.randint(0, 3, (B,), generator=g).float() / 2
    old = -torch.rand(B, T, generator=g) * 3
    spp = old.exp() ** 2 + (1 - old.exp()) ** 2 * torch.rand(B, T, generator=g)
    fn = fn_for(f"{OTB}(align={align}, zero_tail={'true' if zero_tail else 'false'})")
    est = fn.estimate(r, G, mask, old_logprobs=old, sum_pi_squared=spp)
    ref_fn = R.verl_tir_optimal_token_baseline if align == "response_token" else R.verl_optimal_token_baseline
    m = mask.double()
    last = (m * torch.arange(1, T + 1)).argmax(-1)  # the reward sits on the last response token
    tlr = torch.zeros(B, T, dtype=torch.float64).scatter_(1, last[:, None], r.double()[:, None]) * m
    want = ref_fn(tlr, m, [i // G for i in range(B)], old.double(),
                  spp.double(), handle_zero_tail=zero_tail)[0]
    assert torch.isfinite(est.advantages).all()
    torch.testing.assert_close(est.advantages.double() * m, want * m, atol=1e-5, rtol=1e-5)
    if align == "response_token":  # the lone non-empty row of group 1 keeps its whole return
        assert torch.equal(est.advantages[7], est.returns[7] * mask[7])


def test_optimal_token_baseline_is_the_group_mean_for_equal_energies():
    """Equal realized energies at every row (pi, sum pi^2 equal) and equal lengths: B_t is the
    group's mean return at t, i.e. group_mean's advantage (up to the epsilon)."""
    b = reward_batch(5, 4)
    mask = torch.ones_like(b["mask"])
    old = torch.full_like(b["old"], -1.0)
    spp = torch.full_like(b["old"], 0.3)
    otb = fn_for(OTB).estimate(b["r"], 4, mask, old_logprobs=old, sum_pi_squared=spp).advantages
    gm = fn_for("baseline group_mean").estimate(b["r"], 4, mask).advantages
    torch.testing.assert_close(otb, gm, atol=1e-6, rtol=0)
GDPO_TRL = "baseline per_reward_group(eps=0.0001, singleton=zero, whiten=samples, whiten_eps=0.0001)\nnormalizer none"


def test_gdpo_needs_the_per_function_rewards_and_checks_their_shape():
    b = reward_batch(4, 4)
    fn = fn_for("baseline per_reward_group\nnormalizer none")
    with pytest.raises(ValueError, match="reward_components="):
        fn.estimate(b["r"], 4, b["mask"])
    with pytest.raises(ValueError, match=r"reward_components must be \[B, K\]"):
        fn.estimate(b["r"], 4, b["mask"], reward_components=b["comps"][:8])
    with pytest.raises(ValueError, match=r"reward_weights must be \[K\] with .*K = 2; got \(3,\)"):
        fn.estimate(b["r"], 4, b["mask"], reward_components=b["comps"], reward_weights=torch.ones(3))
    # default weights are 1 (both peers' default)
    m = b["mask"].double()
    est = fn.estimate(b["r"], 4, b["mask"], reward_components=b["comps"])
    ref = R.verl_gdpo([token_level_rewards(c, m) for c in b["comps"].T], m, [i // 4 for i in range(16)])
    torch.testing.assert_close(est.advantages.double() * m, ref, rtol=1e-5, atol=1e-6)


def test_gdpo_differs_from_grpo_on_the_summed_reward():
    """The point of GDPO: (1,0) and (0,1) reward pairs sum alike but are normalised per function,
    so with unequal spreads the advantages differ from GRPO's on the weighted sum."""
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.2]])
    mask = torch.ones(4, 3)
    r = comps.sum(-1)
    gdpo = fn_for(GDPO_TRL).estimate(r, 4, mask, reward_components=comps).advantages[:, 0]
    grpo = fn_for("baseline group_mean\nnormalizer group_std(eps=0.0001)").estimate(r, 4, mask).advantages[:, 0]
    ref = R.trl_normalize_then_sum(comps.double(), 4, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(gdpo.double(), ref, rtol=1e-5, atol=1e-6)
    assert (gdpo - grpo).abs().max() > 0.1


def test_gdpo_a_missing_function_reward_is_left_out_as_trl_does():
    """A NaN in one function's column (TRL: that function returned None) leaves its column's
    statistics and the weighted sum; the row keeps the other functions' signal."""
    b = reward_batch(5, 4)
    comps = b["comps"].clone()
    comps[1, 1] = float("nan")
    comps[9, 0] = float("nan")
    est = fn_for(GDPO_TRL).estimate(b["r"], 4, b["mask"], reward_components=comps, reward_weights=b["w"])
    ref = R.trl_normalize_then_sum(comps.double(), 4, b["w"].double()).unsqueeze(-1) * b["mask"].double()
    assert torch.isfinite(est.advantages).all()
    torch.testing.assert_close(est.advantages.double(), ref, rtol=1e-5, atol=1e-6)
