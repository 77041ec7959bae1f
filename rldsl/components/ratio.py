"""ratio: the log importance ratio log(pi_theta / pi_old).

Signature: ``(logp [B, T], old_logp [B, T], mask [B, T], adv [B, T]) -> log_ratio [B, T]``.
The advantage is there for a clip that acts before a sequence mean (GMPO's, sign-aware); the
other ratios ignore it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("ratio", sequence_level=False, roles={"log_ratio_clamp": "clamp"},
          clamp=Float(20.0, "|log rho| is clamped to this (verl 20; large = off)", gt=0))
def token(logp: Tensor, old_logp: Tensor, mask: Tensor, adv: Tensor, clamp: float) -> Tensor:
    """Per-token ratio.

    formula: log rho_it = clamp(log pi(o_it) - log pi_old(o_it), -{clamp}, {clamp})
    source: PPO (Schulman et al. 2017); verl compute_policy_loss_vanilla (clamp 20);
      TRL importance_sampling_level="token" (no clamp)
    shapes: [B, T] -> [B, T]
    """
    return torch.clamp(logp - old_logp, -clamp, clamp)


@register("ratio", sequence_level=True, clamp=Float(10.0, "log s is clamped above at this (verl 10)", gt=0))
def sequence(logp: Tensor, old_logp: Tensor, mask: Tensor, adv: Tensor, clamp: float) -> Tensor:
    """Sequence-level ratio: the geometric mean of the token ratios, with per-token gradients.

    formula: log s_it = sg(sum_t m log rho_it / L_i) + log pi(o_it) - sg(log pi(o_it)), clamped above at {clamp}
    source: GSPO (Zheng et al. 2025); verl loss_mode=gspo; TRL importance_sampling_level="sequence"
    shapes: [B, T] -> [B, T] (the same value on every token of a row)
    """
    valid = mask > 0  # padding may hold garbage (inf): select, never multiply by 0
    lp = torch.where(valid, logp, 0.0)
    lr = torch.where(valid, logp - old_logp, 0.0)
    seq = lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)  # [B, 1]
    out = seq.detach() + lp - lp.detach()
    return torch.clamp(out, max=clamp)


@register("ratio", sequence_level=True, clamp=Float(20.0, "each token's |log rho| and the sum's are clamped to this (VESPO 20)",
                               gt=0))
def product(logp: Tensor, old_logp: Tensor, mask: Tensor, adv: Tensor, clamp: float) -> Tensor:
    """Sequence-level ratio: the product of the token ratios (the sequence likelihood ratio).

    formula: log w_i = clamp(sum_t m_it clamp(log rho_it, -{clamp}, {clamp}), -{clamp}, {clamp}), on every token of row i
    source: VESPO (arXiv 2602.10693) and TRL loss_type="vespo" (each log rho clamped to +-20,
      the sum to [log 1e-8, 20]: the lower bound is gamma_weight's); TRL RLOOTrainer (sum of
      log ratios, no clamp: a large clamp); verl rollout_is=sequence (clamp 20)
    shapes: [B, T] -> [B, T] (the same value on every token of a row)
    edge cases: the gradient is the full one of the row sum, so with seq_mean_token_mean
      aggregation the loss and gradient are those of one sequence-level term per row; padding
      values (even inf) never reach it; an empty row gives 0.
    """
    valid = mask > 0  # padding may hold garbage (inf): select, never multiply by 0
    lr = torch.where(valid, torch.clamp(logp - old_logp, -clamp, clamp), 0.0)
    seq = torch.clamp(lr.sum(-1, keepdim=True), -clamp, clamp)  # [B, 1]
    return seq.expand_as(logp)


@register("ratio", sequence_level=True,
          low=Float(0.4, "for A < 0, log rho_t is clipped from below at -low (verl clip_ratio_low)", gt=0),
          high=Float(0.4, "for A > 0, log rho_t is clipped from above at high (verl clip_ratio_high)", gt=0),
          clamp=Float(None, "if given, |log rho_t| is first clamped to it (verl's optional +-20; "
                            "absent: no clamp, as verl geo_mean)", gt=0))
def geo_mean(logp: Tensor, old_logp: Tensor, mask: Tensor, adv: Tensor, low: float, high: float,
             clamp: float | None) -> Tensor:
    """GMPO's ratio: the geometric mean of sign-aware clipped token ratios.

    formula: x_it = log pi(o_it) - log pi_old(o_it) (clamped to +-{clamp} if given);
      c_it = min(x_it, {high}) if A_it > 0, max(x_it, -{low}) if A_it < 0, 0 if A_it = 0;
      log r_i = sum_t m_it c_it / (|o_i| + 1e-8), on every token of row i
    source: GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673,
      clip range (e^-0.4, e^0.4)); verl loss_mode=geo_mean (clip_ratio_low/high in log space,
      sgn(A) min(sgn(A) x, sgn(A) clamp(x, -low, high))); with `objective ppo`, `trust_region
      none` and `aggregation seq_mean_token_mean(count_empty=true)` the loss is verl's
      mean_i(-mean_t(A) r_i)
    shapes: logp, old_logp, mask, adv [B, T] -> [B, T] (the same value on every token of a row)
    edge cases: a clipped token gets no gradient (as verl's min); padding values (even inf)
      never reach the sum; an empty row gives log r = 0. Without a clamp a negative-advantage
      row whose mean log ratio exceeds ~88 overflows to inf, as verl's does. The clip acts inside
      the ratio, so the clip_fraction metric (w != rho) reads 0.
    """
    valid = mask > 0  # padding may hold garbage (inf): select, never multiply by 0
    x = torch.where(valid, logp - old_logp, 0.0)
    if clamp is not None:
        x = torch.clamp(x, -clamp, clamp)
    c = torch.where(adv > 0, torch.clamp(x, max=high), torch.clamp(x, min=-low))
    c = torch.where((adv != 0) & valid, c, 0.0)
    seq = c.sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + 1e-8)  # [B, 1]
    return seq.expand_as(logp)
