"""Formulas read what the inputs table says a slot receives, and with it write three peer methods
that no formula could before, each against the peer's own numbers (float64, value and gradient):

- GMPO's ratio in the ``ratio`` slot, reading the advantage A (verl loss_mode=geo_mean);
- a baseline reading the critic's values V (verl adv_estimator=gae with gamma = lam = 1);
- TRL's VESPO with vLLM importance sampling: the truncated IS weight folded into the sequence
  ratio inside phi, reading the engine's logprobs rollout_logp in the ``trust_region`` slot.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import peer_refs as R
from correction_refs import trl_is_ratio
from peer_cases import LossCase, fn_for, loss_batch, reward_batch, run_loss, token_level_rewards

import rldsl
from rldsl.formula import lang

ROOT = Path(__file__).resolve().parents[2]

GMPO_RATIO = """
define gmpo_ratio
  low = 0.4
  high = 0.4
  lr = logp - old_logp
  s = sign(A)
  log_rho = seq_sum(s * min(s * lr, s * clamp(lr, -low, high))) / (L + 0.00000001)   # verl's |o| + 1e-8
end
ratio gmpo_ratio
aggregation seq_mean_token_mean(count_empty=true)
"""

GMPO_RATIO_CLAMPED = """
define gmpo_ratio
  low = 0.2
  high = 0.28
  lr = clamp(logp - old_logp, -20, 20)
  s = sign(A)
  log_rho = seq_sum(s * min(s * lr, s * clamp(lr, -low, high))) / (L + 0.00000001)   # verl's |o| + 1e-8
end
ratio gmpo_ratio
aggregation seq_mean_token_mean(count_empty=true)
"""

# TRL vllm_importance_sampling_mode="token_truncate", cap 3: w_t = min(pi_old / pi_engine, 3)
VESPO_IS = """
define vespo_is
  k_pos = 2.0
  lambda_pos = 3.0
  k_neg = 3.0
  lambda_neg = 2.0
  cap = 3.0
  lr = clamp(logp - old_logp, -20, 20)
  log_is = clamp(min(old_logp - rollout_logp, log(cap)), log(0.00000001), 20)
  log_w = clamp(seq_sum(lr) + seq_sum(log_is), log(0.00000001), 20)
  k = where(A >= 0, k_pos, k_neg)
  lam = where(A >= 0, lambda_pos, lambda_neg)
  w = sg(exp(lam + k * log_w - lam * exp(log_w)))
end
trust_region vespo_is
objective is_weighted
aggregation token_mean
"""


def trl_vespo_is(b: dict, mode: str = "token_truncate", cap: float = 3.0) -> torch.Tensor:
    """TRL 1.16 loss_type="vespo" with vllm_importance_sampling_correction: the IS ratio (the
    mode's, clipped at ``cap``) is folded into the sequence log ratio inside get_gamma_weights
    (log clamped to [log 1e-8, 20], summed over the row) instead of multiplying the loss."""
    is_ratio = trl_is_ratio(b["old"], b["roll"], b["mask"], mode=mode, clip_max=cap)
    a = b["a"].unsqueeze(1)
    log_ratio = b["logp"] - b["old"]
    phi = R.trl_gamma_weights(a, log_ratio, b["mask"], importance_sampling_ratio=is_ratio)
    per_token_loss = -phi * a * b["logp"]
    return (per_token_loss * b["mask"]).sum() / b["mask"].sum().clamp(min=1.0)


def _exact(case: LossCase, seed: int) -> None:
    b = loss_batch(seed)
    ours, ref, g, g_ref = run_loss(case, b)
    assert torch.isfinite(ours) and torch.isfinite(g).all()
    assert abs(ours.item() - ref.item()) <= 1e-8 * max(1.0, abs(ref.item())), (ours.item(), ref.item())
    assert (g - g_ref).abs().max().item() <= 1e-8 * max(1.0, g_ref.abs().max().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmpo_ratio_as_a_ratio_formula_equals_verl_geo_mean(seed):
    _exact(LossCase("verl", "geo_mean", GMPO_RATIO, lambda b: R.verl_geo_mean(b["old"], b["logp"], b["adv"], b["mask"])),
           seed)
    _exact(LossCase("verl", "geo_mean clamp", GMPO_RATIO_CLAMPED, lambda b: R.verl_geo_mean(
        b["old"], b["logp"], b["adv"], b["mask"], clip_ratio_low=0.2, clip_ratio_high=0.28, clamp_20=True)), seed)


def test_the_ratio_formula_reads_the_advantage_and_is_sequence_level():
    fn = fn_for(GMPO_RATIO)
    v = fn.algorithm["ratio"]
    assert "A" in v.formula.reads and v.spec.flag("sequence_level", v.params)
    assert "A" in lang.SLOTS["ratio"].inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_vespo_with_vllm_importance_sampling_equals_trl(seed, mode):
    spec = VESPO_IS if mode == "token_truncate" else VESPO_IS.replace(
        "log_is = clamp(min(old_logp - rollout_logp, log(cap)), log(0.00000001), 20)",
        "log_is = clamp(min(seq_sum(old_logp - rollout_logp), log(cap)), log(0.00000001), 20)").replace(
        "seq_sum(lr) + seq_sum(log_is)", "seq_sum(lr) + log_is")
    case = LossCase("TRL", f"vespo + {mode}", spec, lambda b: trl_vespo_is(b, mode), kw={"roll": True})
    _exact(case, seed)
    # the IS weight matters: without the engine's logprobs folded in, the loss differs
    b = loss_batch(seed)
    assert abs(trl_vespo_is(b, mode).item() - R.trl_loss(b["logp"], b["old"], b["a"], b["mask"],
                                                           loss_type="vespo").item()) > 1e-6


def test_vespo_is_needs_the_engine_logprobs():
    fn = fn_for(VESPO_IS)
    assert "rollout_logprobs" in fn.algorithm.needs("loss")
    b = loss_batch(0)
    with pytest.raises(ValueError, match=r"loss\(\) needs rollout_logprobs= for trust_region vespo_is"):
        fn.loss(b["logp"], b["old"], b["adv"], b["mask"])


def test_the_example_spec_is_the_tested_formula():
    algo = rldsl.load(str(ROOT / "algorithms" / "examples" / "vespo_is.rl"))
    tested = fn_for(VESPO_IS).algorithm["trust_region"]
    assert algo["trust_region"].formula.order == tested.formula.order
    assert algo["trust_region"].params == tested.params
    b = loss_batch(1)
    ours = rldsl.compile(algo, compile=False).loss(b["logp"], b["old"], b["adv"], b["mask"],
                                                    rollout_logprobs=b["roll"], group_size=1).loss
    assert abs(ours.item() - trl_vespo_is(b).item()) <= 1e-8 * max(1.0, abs(ours.item()))


CRITIC_BASELINE = """
define minus_value
  A = r - V
end
baseline minus_value
normalizer whiten
critic value
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 4])
def test_a_baseline_formula_reads_the_critic_values_as_verl_gae_with_lambda_1(seed, G):
    """A_t = R - V_t: verl's GAE with gamma = lam = 1 (the reward on the last token), whitened."""
    b = reward_batch(seed, G)
    fn = fn_for(CRITIC_BASELINE)
    est = fn.estimate(b["r"], G, b["mask"], values=b["values"])
    m = b["mask"].double()
    want = R.verl_gae(token_level_rewards(b["r"], b["mask"]), b["values"].double(), m, 1.0, 1.0) * m
    torch.testing.assert_close(est.advantages.double() * m, want, rtol=1e-5, atol=1e-5)
    # value targets: A + V before whitening, the GAE returns (here R on every response token)
    r_tok = b["r"].double().unsqueeze(-1) * m
    torch.testing.assert_close(est.returns.double() * m, r_tok, rtol=1e-5, atol=1e-5)


def test_a_baseline_reading_values_needs_a_critic():
    with pytest.raises(rldsl.SpecError, match="needs a critic"):
        rldsl.loads("algorithm t\n" + CRITIC_BASELINE.replace("critic value\n", ""), "t.rl")
    with pytest.raises(ValueError, match=r"estimate\(\) needs values= for baseline minus_value"):
        fn_for(CRITIC_BASELINE).estimate(torch.ones(4), 2, torch.ones(4, 3))


def test_log_of_a_tiny_constant_is_folded():
    assert math.isclose(math.log(1e-8), -18.420680743952367)
