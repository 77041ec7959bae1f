"""normalizer: scales the centred advantage.

Signature: ``(adv [B, T], batch: AdvantageBatch) -> adv [B, T]``. Statistics are of the
sequence rewards ``batch.rewards`` (after shaping), except ``whiten`` (token advantages).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ops import AdvantageBatch, group_view, keyed_moments, masked_whiten, moments
from ..registry import Bool, Float, Requires, register
from .baseline import GroupBy

if TYPE_CHECKING:
    from torch import Tensor


@register("normalizer", off=True)
def none(adv: Tensor, batch: AdvantageBatch) -> Tensor:
    """No scaling.

    formula: A_i = r_i - b_i
    source: Dr. GRPO (Liu et al. 2025) removes GRPO's std; RLOO
    shapes: [B, T] -> [B, T]
    """
    return adv


@register("normalizer", per_group=True, roles={"denominator_eps": "eps"},
          eps=Float(1e-6, "added to the std (verl, ROLL 1e-6; TRL 1e-4)", ge=0),
          unbiased=Bool(True, "Bessel (N-1) std, as verl, TRL and ROLL"),
          group_by=GroupBy("take the std of"))
def group_std(adv: Tensor, batch: AdvantageBatch, eps: float, unbiased: bool,
              group_by: str | None = None) -> Tensor:
    """Divide by the std of the rewards of the prompt's group.

    formula: A_i = (r_i - b_i) / (std_{j in g(i)} r_j + {eps})
    source: GRPO (Shao et al. 2024); verl compute_grpo_outcome_advantage (Bessel, eps 1e-6);
      TRL scale_rewards="group" (Bessel, eps=1e-4)
    shapes: [B, T] -> [B, T]
    edge cases: zero-variance groups give A = 0 (the numerator is 0); a group of one uses std 1.
      group_by=FIELD: g(i) is every row whose FIELD equals row i's (across prompts, any size).
    """
    if group_by is not None:
        _, s, _ = keyed_moments(batch.rewards, batch.valid_rows, batch.group_keys, unbiased)  # [B]
        return adv / (s + eps).unsqueeze(-1)
    G = batch.group_size
    r, v = group_view(batch.rewards, G), group_view(batch.valid_rows, G)  # [P, G]
    _, s, _ = moments(r, v, unbiased)  # [P, 1]
    return adv / (s.expand_as(r).reshape(-1) + eps).unsqueeze(-1)


@register("normalizer", roles={"denominator_eps": "eps"},
          eps=Float(1e-6, "added to the std (ROLL 1e-6; TRL 1e-4)", ge=0),
          unbiased=Bool(True, "Bessel (N-1) std"))
def batch_std(adv: Tensor, batch: AdvantageBatch, eps: float, unbiased: bool) -> Tensor:
    """Divide by the std of all rewards of the batch (the mean stays per group).

    formula: A_i = (r_i - b_i) / (std_{j in batch} r_j + {eps})
    source: Lite PPO (Liu et al. 2025, "Tricks or Traps?"): group mean, batch std; ROLL
      norm_std_type=batch (raw rewards, Bessel, 1e-6); TRL scale_rewards="batch" (1e-4)
    shapes: [B, T] -> [B, T]
    """
    _, s, _ = moments(batch.rewards, batch.valid_rows, unbiased)  # [1]
    return adv / (s + eps)


@register("normalizer", per_group=True,
          requires=Requires("rewards", "binary", "the success rate is the mean of 0/1 rewards"),
          eps=Float(1e-6, "added to the success rate", gt=0),
          group_by=GroupBy("take the success rate of"))
def success_rate(adv: Tensor, batch: AdvantageBatch, eps: float, group_by: str | None = None) -> Tensor:
    """Divide by the group's success rate (mean binary reward): MaxRL's p-normalisation.

    formula: A_i = (r_i - b_i) / (mean_{j in g(i)} r_j + {eps})
    source: MaxRL (Tajwar et al. 2026), compute_maxrl_outcome_advantage (eps 1e-6);
      with b = group_mean: successes get (1-p)/p, failures -1
    shapes: [B, T] -> [B, T]
    edge cases: all-fail and all-pass groups give A = 0; needs `rewards binary`.
      group_by=FIELD: g(i) is every row whose FIELD equals row i's (rows whose reward failed
      left out).
    """
    if group_by is not None:
        p, _, _ = keyed_moments(batch.rewards, batch.valid_rows, batch.group_keys)  # [B]
        return adv / (p + eps).unsqueeze(-1)
    r = group_view(batch.rewards, batch.group_size)  # [P, G]
    p = r.mean(dim=1, keepdim=True).expand_as(r).reshape(-1)  # [B]
    return adv / (p + eps).unsqueeze(-1)


@register("normalizer", roles={"denominator_eps": "eps"},
          eps=Float(1e-8, "added to the variance", ge=0),
          shift_mean=Bool(True, "subtract the token mean (false: only scale)"))
def whiten(adv: Tensor, batch: AdvantageBatch, eps: float, shift_mean: bool) -> Tensor:
    """Whiten token advantages over every response token of the batch.

    formula: A_it = (A_it - mean_m A) / sqrt(var_m A + {eps}),  mean/var over masked tokens, var with Bessel
    source: PPO for RLHF; verl masked_whiten (after gae, reinforce_plus_plus); ROLL whiten_advantages
    shapes: [B, T] -> [B, T]
    edge cases: with fewer than 2 tokens the advantages are returned unchanged (verl raises).
    """
    return masked_whiten(adv, batch.mask, eps, shift_mean)


@register("normalizer",
          f_norm=Float(1.0, "a further constant divisor (verl f_norm)", gt=0))
def nonzero_rate(adv: Tensor, batch: AdvantageBatch, f_norm: float) -> Tensor:
    """Divide by the share of samples with a nonzero reward (GPG's alpha), and by f_norm.

    formula: A_i = alpha (r_i - b_i) / {f_norm},  alpha = B / max(1, #{j : r_j != 0})
    source: GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline",
      arXiv 2504.02546); verl adv_estimator=gpg (with `baseline group_mean(singleton=reward)`)
    shapes: [B, T] -> [B, T]
    edge cases: a batch without any nonzero reward uses alpha = B; B and the count cover the
      samples whose reward is real (a failed reward is neither counted nor a sample).
    """
    v = batch.valid_rows
    n = v.sum().to(adv.dtype)
    nonzero = ((batch.rewards != 0) & v).sum().to(adv.dtype)
    return adv * (n / nonzero.clamp_min(1)) / f_norm
