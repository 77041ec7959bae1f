"""kl slot: k1/k2/k3 values, verl's clamped k3 (low_var_kl) vs TRL's unclamped, rho-weighted k3,
and KL in the reward (TRL RLOO, PPO token rewards)."""
from __future__ import annotations

import math

import pytest
import torch

from component_refs import assert_close, lists, random_batch, spec_fn
from rldsl.components import kl

LN2 = math.log(2.0)


def test_k1_k2_k3_hand_numbers():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([0.0])  # log pi_ref - log pi = ln 2
    one = torch.ones(1)
    assert kl.k1(logp, ref, one).item() == pytest.approx(-LN2)
    assert kl.k2(logp, ref, one).item() == pytest.approx(0.5 * LN2 ** 2)
    assert kl.k3(logp, ref, one, clamp=False, ratio_weighted=False).item() == pytest.approx(2 - LN2 - 1)
    rho = torch.tensor([1.5])
    assert kl.k3(logp, ref, rho, clamp=False, ratio_weighted=True).item() == pytest.approx(1.5 * (1 - LN2))


def verl_low_var_kl(lp: float, ref: float) -> tuple[float, float]:
    """verl kl_penalty(low_var_kl): x = clamp(ref - lp, -20, 20); clamp(e^x - x - 1, -10, 10).
    Returns (value, d value / d lp)."""
    x_raw = ref - lp
    x = min(max(x_raw, -20.0), 20.0)
    v = math.exp(x) - x - 1
    dv = -(math.exp(x) - 1) if -20 < x_raw < 20 else 0.0
    if v > 10:
        return 10.0, 0.0
    return v, dv


def trl_k3(lp: float, ref: float, old: float) -> tuple[float, float]:
    """TRL: (e^{ref - lp} - (ref - lp) - 1) * rho, rho = e^{lp - old} (use_bias_correction_kl)."""
    x, rho = ref - lp, math.exp(lp - old)
    k = math.exp(x) - x - 1
    return k * rho, (1 - math.exp(x)) * rho + k * rho


def test_verl_k3_clamps_hand_numbers():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([25.0, -25.0, 3.0, 2.0])
    v = kl.k3(logp, ref, torch.ones(4), clamp=True, ratio_weighted=False)
    # 25 -> x=20 -> e^20-21 -> 10; -25 -> x=-20 -> 19 -> 10; 3 -> 16.09 -> 10; 2 -> e^2 - 3
    assert lists(v) == pytest.approx([10.0, 10.0, 10.0, math.exp(2) - 3])
    (g,) = torch.autograd.grad(v.sum(), logp)
    assert lists(g) == pytest.approx([0.0, 0.0, 0.0, 1 - math.exp(2)])
    unclamped = kl.k3(logp, ref, torch.ones(4), clamp=False, ratio_weighted=False)
    assert unclamped[0].item() == pytest.approx(math.exp(25) - 26, rel=1e-6)
    # the exponent clamp keeps exp() finite: at x = 100 float32 exp overflows, and without it the
    # zero gradient of the value clamp would meet an infinite d/dx (0 * inf = NaN)
    far = torch.tensor([0.0, 0.0], requires_grad=True)
    v = kl.k3(far, torch.tensor([100.0, -100.0]), torch.ones(2), clamp=True, ratio_weighted=False)
    (g,) = torch.autograd.grad(v.sum(), far)
    assert lists(v) == [10.0, 10.0] and lists(g) == [0.0, 0.0]


def kl_only_loss(line: str, b, ratio_line: str = ""):
    """With A = 0 the policy term vanishes: the loss is beta * token_mean(kl)."""
    fn = spec_fn(f"kl {line}\ntrust_region clip\n{ratio_line}")
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], torch.zeros_like(lp), b["mask"], ref_logprobs=b["ref"])
    (g,) = torch.autograd.grad(out.loss, lp)
    return out, g


def per_token_ref(b, ref_fn):
    M, L, R, O = lists(b["mask"]), lists(b["logp"]), lists(b["ref"]), lists(b["old"])
    n = sum(map(sum, M))
    tot, grad = 0.0, []
    for i in range(len(M)):
        row = []
        for t in range(len(M[0])):
            v, d = ref_fn(L[i][t], R[i][t], O[i][t]) if M[i][t] > 0 else (0.0, 0.0)
            tot += v * M[i][t]
            row.append(d * M[i][t] / n)
        grad.append(row)
    return tot / n, grad


@pytest.mark.parametrize("seed", [0, 1])
def test_verl_low_var_kl_in_the_loss(seed):
    b = random_batch(5, 6, seed, empty_rows=(1,))
    b["ref"][0, :3] = b["logp"][0, :3] + torch.tensor([25.0, 3.0, -25.0])  # clamps reached
    out, g = kl_only_loss("k3(beta=0.5, where=loss, clamp=true)", b)
    want, dwant = per_token_ref(b, lambda lp, ref, old: verl_low_var_kl(lp, ref))
    assert out.loss.item() == pytest.approx(0.5 * want, rel=1e-5)
    assert_close(g, [[0.5 * d for d in r] for r in dwant], rtol=1e-4, atol=1e-7)
    assert out.metrics["kl"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_trl_k3_unclamped_ratio_weighted(seed):
    b = random_batch(5, 6, seed, empty_rows=(1,))
    out, g = kl_only_loss("k3(beta=0.04, where=loss, ratio_weighted=true)", b, "ratio token(clamp=1000.0)")
    want, dwant = per_token_ref(b, trl_k3)
    assert out.loss.item() == pytest.approx(0.04 * want, rel=1e-5)
    assert_close(g, [[0.04 * d for d in r] for r in dwant], rtol=1e-4, atol=1e-7)


def test_k1_in_the_reward_rloo_hand_numbers(eager_algorithm):
    """TRL RLOOTrainer: r <- r - beta * sum_t (log pi_old - log pi_ref), beta = 0.05, then RLOO."""
    fn = eager_algorithm("rloo")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, 7.0], [-1.0, 5.0, 5.0]])
    ref = torch.tensor([[-1.2, -2.4, 0.0], [-0.5, 0.0, 0.0]])
    est = fn.estimate(torch.tensor([1.0, 0.0]), 2, mask, old_logprobs=old, ref_logprobs=ref)
    r0, r1 = 1.0 - 0.05 * (0.2 + 0.4), 0.0 - 0.05 * (-0.5)  # 0.97, 0.025
    assert lists(est.rewards) == pytest.approx([r0, r1])
    assert_close(est.advantages, [[r0 - r1, r0 - r1, 0], [r1 - r0, 0, 0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        fn.estimate(torch.tensor([1.0, 0.0]), 2, mask)


def test_kl_in_the_reward_enters_gae_per_token():
    """PPO-RLHF: token reward = -beta * kl_t, plus the outcome on the last token."""
    fn = spec_fn("baseline gae(gamma=1.0, lam=1.0)\ncritic value\nkl k1(beta=0.1, where=reward)")
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.5, -1.0]])  # k1 = 1, 0.5, 0 -> token rewards -0.1, -0.05, 0 (+1 last)
    values = torch.tensor([[0.2, 0.3, 0.4]])
    est = fn.estimate(torch.tensor([1.0]), 1, mask, values=values, old_logprobs=old, ref_logprobs=ref)
    # gamma = lam = 1: A_t = sum_{k >= t} r_k - V_t
    assert_close(est.advantages, [[0.85 - 0.2, 0.95 - 0.3, 1.0 - 0.4]])
    assert lists(est.rewards) == pytest.approx([0.85])
