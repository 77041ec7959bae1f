"""trust_region: turns the ratio rho into the weight ``w`` the objective uses.

Signature: ``(rho [B, T], adv [B, T], logp [B, T], old_logp [B, T]) -> w [B, T]``.
``w`` carries rho's gradient where the trust region lets it through and is constant (or 0)
where it does not. With ``objective ppo`` the loss is ``-A w``, so the PPO clip
``max(-A rho, -A clip(rho))`` is written as ``w = min(rho, 1+high)`` for A >= 0 and
``w = max(rho, 1-low)`` for A < 0 (the same values and gradients).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Float, register


@register("trust_region", off=True)
def none(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor) -> Tensor:
    """No trust region.

    formula: w = rho
    source: -
    shapes: [B, T] -> [B, T]
    """
    return rho


@register("trust_region", per_token_only=False,
          low=Float(0.2, "epsilon_low: the ratio may fall to 1 - low", gt=0, lt=1),
          high=Float(0.2, "epsilon_high: the ratio may rise to 1 + high", gt=0))
def clip(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, low: float, high: float) -> Tensor:
    """PPO's pessimistic clip (decoupled bounds: DAPO's clip-higher).

    formula: w = min(rho, 1+{high}) if A >= 0 else max(rho, 1-{low})   (i.e. loss max(-A rho, -A clip(rho, 1-{low}, 1+{high})))
    source: PPO (Schulman et al. 2017); DAPO clip-higher (Yu et al. 2025, 0.2/0.28);
      TRL epsilon/epsilon_high; verl clip_ratio_low/high without dual clip
    shapes: [B, T] -> [B, T]
    """
    return torch.where(adv >= 0, torch.clamp(rho, max=1 + high), torch.clamp(rho, min=1 - low))


@register("trust_region", per_token_only=False,
          low=Float(0.2, "epsilon_low", gt=0, lt=1),
          high=Float(0.2, "epsilon_high", gt=0),
          c=Float(3.0, "bound on the loss of negative advantages, in units of |A|", gt=1))
def dual_clip(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, low: float, high: float,
              c: float) -> Tensor:
    """PPO clip plus a lower bound on the loss for negative advantages (dual clip).

    formula: w = min(rho, 1+{high}) if A >= 0 else min(max(rho, 1-{low}), {c})
    source: Ye et al. 2019 (dual-clip PPO); verl compute_policy_loss_vanilla (always on,
      clip_ratio_c = 3.0; DAPO recipe 10.0); ROLL dual_clip_loss (c = 1 + 2 eps)
    shapes: [B, T] -> [B, T]
    """
    pos = torch.clamp(rho, max=1 + high)
    neg = torch.clamp(torch.clamp(rho, min=1 - low), max=c)
    return torch.where(adv >= 0, pos, neg)


@register("trust_region", per_token_only=False,
          high=Float(doc="the weight is capped at 1 + high", gt=-1),
          low=Float(None, "if given, the weight is floored at 1 - low", gt=0, lt=1))
def truncate(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, high: float,
             low: float | None) -> Tensor:
    """Truncated importance weight, independent of the sign of A (CISPO / TIS).

    formula: w = clamp(rho, 1-{low}, 1+{high})   (no lower bound unless low is given)
    source: CISPO (MiniMax-M1 2025, eps_high^IS); verl loss_mode=cispo = truncate(low, high)
      with its clip_ratio_low/high; TRL loss_type="cispo" caps at epsilon_high itself,
      i.e. high = epsilon_high - 1 (ScaleRL eps_max 5.0 -> high=4.0)
    shapes: [B, T] -> [B, T]
    """
    w = torch.clamp(rho, max=1 + high)
    if low is not None:
        w = torch.clamp(w, min=1 - low)
    return w


@register("trust_region", per_token_only=True,
          low=Float(0.15, "delta for A <= 0: pi may fall by at most this probability", gt=0, le=1),
          high=Float(0.15, "delta for A > 0: pi may rise by at most this probability", gt=0, le=1),
          cap=Float(None, "if given, the weight is also truncated at this value", gt=0))
def tv(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, low: float, high: float,
       cap: float | None) -> Tensor:
    """Binary total-variation trust region: mask tokens whose probability moved too far in A's direction.

    formula: w = rho * valid (rho capped at {cap} if given); valid = (p - p_old <= {high}) if A > 0 else (p - p_old >= -{low}), p = exp(log pi)
    source: DPPO (Qi et al. 2026, Binary-TV, delta 0.15); verl loss_mode=dppo_tv
      (delta = clip_ratio_low/high, cap = clip_ratio_c) -- measured against the old policy
    shapes: [B, T] -> [B, T]
    """
    with torch.no_grad():
        diff = torch.exp(logp) - torch.exp(old_logp)
        valid = torch.where(adv > 0, diff <= high, diff >= -low)
    w = rho if cap is None else torch.clamp(rho, max=cap)
    return w * valid.to(w.dtype)


@register("trust_region", per_token_only=True,
          low=Float(0.05, "delta for A <= 0 (binary KL bound)", gt=0),
          high=Float(0.05, "delta for A > 0 (binary KL bound)", gt=0),
          cap=Float(None, "if given, the weight is also truncated at this value", gt=0))
def kl_div(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, low: float, high: float,
           cap: float | None) -> Tensor:
    """Binary-KL trust region: mask tokens whose binary KL to the old policy exceeds delta, only in A's direction.

    formula: D = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p)); valid = (D <= {high} or p <= p_old) if A > 0 else (D <= {low} or p >= p_old); w = rho * valid
    source: DPPO (Qi et al. 2026, Binary-KL, delta 0.05); verl loss_mode=dppo_kl (1e-8 inside the log)
    shapes: [B, T] -> [B, T]
    """
    with torch.no_grad():
        p, p_old = torch.exp(logp), torch.exp(old_logp)
        d = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = torch.where(adv > 0, (d <= high) | (p <= p_old), (d <= low) | (p >= p_old))
    w = rho if cap is None else torch.clamp(rho, max=cap)
    return w * valid.to(w.dtype)
