"""Dense rewards (`rewards dense`, the ``dense_rewards`` input): GAE and REINFORCE++ on token-level
rewards exact against verl 0.9.1's own ``compute_gae_advantage_return`` and
``compute_reinforce_plus_plus_outcome_advantage`` and ReMax's ``compute_remax_outcome_advantage``
(float64, the components; float32, through
``estimate()``), the token rewards a dense spec builds, and an outcome-only spec left as it was."""
from __future__ import annotations

import pytest
import torch

import rldsl
from rldsl import ops
from rldsl.components import baseline as bl
from rldsl.components import normalizer as nm
from rldsl.ops import AdvantageBatch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.trainer.config import AlgoConfig  # noqa: E402  (after the skip)


def multi_turn(seed: int, B: int = 6, T: int = 12, dtype=torch.float64):
    """Rows laid out as episodes: model turns (mask 1) with environment tokens between them (mask
    0), a reward on the last token of each model turn, values everywhere; one empty row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=dtype)
    dense = torch.zeros(B, T, dtype=dtype)
    for i in range(B - 1):
        t = 0
        while t < T:
            n = int(torch.randint(1, 4, (1,), generator=g))  # a turn of 1-3 model tokens
            end = min(T, t + n)
            mask[i, t:end] = 1
            dense[i, end - 1] = float(torch.randn(1, generator=g, dtype=dtype))
            t = end + int(torch.randint(1, 3, (1,), generator=g))  # then 1-2 environment tokens
    values = torch.randn(B, T, generator=g, dtype=dtype)
    return dense, mask, values


def batch64(dense, mask, values=None) -> AdvantageBatch:
    r = dense.sum(-1)
    return AdvantageBatch(rewards=r, raw_rewards=r, token_rewards=dense, mask=mask, group_size=1, values=values)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_on_token_rewards_equals_verl(seed, gamma, lam):
    dense, mask, values = multi_turn(seed)
    b = batch64(dense, mask, values)
    adv, ret = bl.gae(b, gamma=gamma, lam=lam)
    adv = nm.whiten(adv, b, eps=1e-8, shift_mean=True)  # verl whitens inside its estimator
    v_adv, v_ret = core_algos.compute_gae_advantage_return(dense, values, mask, gamma, lam)
    torch.testing.assert_close(adv * mask, v_adv * mask, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret * mask, v_ret * mask, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_reinforce_pp_on_token_rewards_equals_verl(seed, gamma):
    """REINFORCE++'s token-level form: the discounted return-to-go of the token rewards
    (`baseline return_to_go`), whitened over the batch's tokens (`normalizer whiten`)."""
    dense, mask, _ = multi_turn(seed)
    b = batch64(dense, mask)
    adv, ret = bl.return_to_go(b, gamma=gamma)
    adv = nm.whiten(adv, b, eps=1e-8, shift_mean=True)
    v_adv, v_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        dense, mask, config=AlgoConfig(gamma=gamma))
    torch.testing.assert_close(adv * mask, v_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, v_ret, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_remax_on_token_rewards_equals_verl(seed):
    """ReMax (`baseline greedy_reward`) reads the token rewards too: the reward-to-go of the turns'
    rewards minus the greedy rollout's reward, against verl's compute_remax_outcome_advantage."""
    dense, mask, _ = multi_turn(seed)
    b = batch64(dense, mask)
    base = torch.randn(dense.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    b.reward_baselines = base
    adv, ret = bl.greedy_reward(b)
    v_adv, v_ret = core_algos.compute_remax_outcome_advantage(dense, base, mask)
    torch.testing.assert_close(adv * mask, v_adv * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret * mask, v_ret * mask, rtol=0, atol=1e-12)


def test_token_rewards_keep_the_turns_and_put_the_rest_on_the_last_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    dense = torch.tensor([[0, 0.5, 0, 0, 0, 0.25, 0], [0.3, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
                         dtype=torch.float64)
    r = torch.tensor([1.75, 0.3, 2.0], dtype=torch.float64)  # row 0: 0.5 + 0.25 from the turns, 1.0 more
    out = ops.dense_token_rewards(r, dense, mask)
    assert out.tolist() == [[0, 0.5, 0, 0, 0, 1.25, 0], [0.3, 0, 0, 0, 0, 0, 0], [0] * 7]
    torch.testing.assert_close(out.sum(-1)[:2], r[:2])
    # a reward on a token off the mask (an environment token) is never kept
    off = ops.dense_token_rewards(torch.tensor([1.0], dtype=torch.float64),
                                  torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64),
                                  torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64))
    assert off.tolist() == [[0.0, 0.0, 1.0]]


DENSE_PPO = """
algorithm ppo_dense extends ppo
  "PPO on per-turn rewards, no KL."
  rewards   dense
  kl        none
"""

DENSE_RPP = """
algorithm rpp_dense extends reinforce_pp
  "REINFORCE++ on per-turn rewards, no KL."
  rewards   dense
  kl        none
"""


@pytest.mark.parametrize("seed", range(3))
def test_estimate_of_a_dense_spec_equals_verl_on_token_level_scores(seed):
    """Through estimate() (float32): the token rewards of a dense spec are the turns' rewards plus,
    on the last token, what the sequence reward has beyond them (a second, outcome term); verl is
    fed exactly those token-level scores."""
    dense, mask, values = multi_turn(seed)
    outcome = torch.randn(dense.shape[0], generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)
    r = dense.sum(-1) + outcome
    scores = dense + ops.last_token(outcome, mask)
    f32 = dict(group_size=1, mask=mask.float())
    ppo = rldsl.compile(rldsl.loads(DENSE_PPO), compile=False)
    est = ppo.estimate(r.float(), values=values.float(), dense_rewards=dense.float(), **f32)
    v_adv, v_ret = core_algos.compute_gae_advantage_return(scores, values, mask, 1.0, 0.95)
    torch.testing.assert_close(est.advantages.double(), v_adv * mask, rtol=0, atol=2e-5)
    torch.testing.assert_close(est.returns.double(), v_ret * mask, rtol=0, atol=2e-5)
    rpp = rldsl.compile(rldsl.loads(DENSE_RPP), compile=False)
    est = rpp.estimate(r.float(), dense_rewards=dense.float(), **f32)
    v_adv, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(scores, mask, config=AlgoConfig(gamma=1.0))
    torch.testing.assert_close(est.advantages.double(), v_adv, rtol=0, atol=2e-5)


def test_an_outcome_spec_sees_the_sum_and_a_dense_spec_needs_the_input():
    dense, mask, values = multi_turn(0, dtype=torch.float32)
    r = dense.sum(-1)
    ppo = rldsl.compile(rldsl.load("ppo"), compile=False)
    assert "dense_rewards" not in ppo.algorithm.needs()
    outcome = ppo.estimate(r, 1, mask, values=values, old_logprobs=torch.zeros_like(mask),
                           ref_logprobs=torch.zeros_like(mask))
    scores = ops.last_token(r.double(), mask.double())  # the sum on the last token, as before
    v_adv, _ = core_algos.compute_gae_advantage_return(scores, values.double(), mask.double(), 1.0, 0.95)
    torch.testing.assert_close(outcome.advantages.double(), v_adv * mask, rtol=0, atol=2e-5)
    dense_fn = rldsl.compile(rldsl.loads(DENSE_PPO), compile=False)
    assert dense_fn.algorithm.needs("advantage")[0] == "dense_rewards"
    with pytest.raises(ValueError, match=r"estimate\(\) needs dense_rewards= for rewards dense"):
        dense_fn.estimate(r, 1, mask, values=values)
    with pytest.raises(ValueError, match=r"dense_rewards must be \[B, T\]"):
        dense_fn.estimate(r, 1, mask, values=values, dense_rewards=dense[:, :3])
