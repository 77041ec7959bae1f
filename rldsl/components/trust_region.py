"""trust_region: turns the ratio rho into the weight ``w`` the objective uses.

Signature: ``(rho [B, T], adv [B, T], logp [B, T], old_logp [B, T]) -> w [B, T]``.
``w`` carries rho's gradient where the trust region lets it through and is constant (or 0)
where it does not. With ``objective ppo`` the loss is ``-A w``, so the PPO clip
``max(-A rho, -A clip(rho))`` is written as ``w = min(rho, 1+high)`` for A >= 0 and
``w = max(rho, 1-low)`` for A < 0 (the same values and gradients).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("trust_region", off=True)
def none(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor) -> Tensor:
    """No trust region.

    formula: w = rho
    source: -
    shapes: [B, T] -> [B, T]
    """
    return rho


@register("trust_region", per_token_only=False, roles={"epsilon_low": "low", "epsilon_high": "high"},
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


@register("trust_region", per_token_only=False, roles={"epsilon_low": "low", "epsilon_high": "high"},
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


@register("trust_region", per_token_only=False, roles={"cap_offset": "high"},
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


@register("trust_region", per_token_only=False,
          tau_pos=Float(1.0, "gate temperature where A > 0 (TRL sapo_temperature_pos, verl tau_pos)", gt=0),
          tau_neg=Float(1.05, "gate temperature where A <= 0 (TRL sapo_temperature_neg, verl tau_neg)", gt=0))
def soft_gate(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, tau_pos: float,
              tau_neg: float) -> Tensor:
    """SAPO's soft gate: a smooth, temperature-controlled stand-in for the hard clip.

    formula: w = (4/tau) sigmoid(tau (rho - 1)),  tau = {tau_pos} if A > 0 else {tau_neg}   (dw/drho = 1 at rho = 1)
    source: SAPO ("Soft Adaptive Policy Optimization", Qwen 2025, arXiv 2511.20347);
      TRL loss_type="sapo"; verl loss_mode=sapo (which also clamps log rho to +-20 and forces
      seq-mean-token-mean)
    shapes: [B, T] -> [B, T]
    edge cases: the weight is never exactly rho, so the clip_fraction metric counts every token;
      the gate lies between (4/tau) sigmoid(-tau) at rho = 0 and 4/tau as rho grows, and its
      gradient 4 sigmoid'(tau (rho - 1)) vanishes smoothly away from rho = 1.
    """
    tau = torch.where(adv > 0, torch.full_like(rho, tau_pos), torch.full_like(rho, tau_neg))
    return torch.sigmoid(tau * (rho - 1)) * (4.0 / tau)


_LOG_MIN_W = math.log(1e-8)


@register("trust_region", per_token_only=False,
          k_pos=Float(2.0, "power of w where A >= 0 (TRL vespo_k_pos)", ge=0),
          lambda_pos=Float(3.0, "decay of w where A >= 0 (TRL vespo_lambda_pos; TRL raises < 1e-4 to 1e-4)",
                           ge=1e-4),
          k_neg=Float(3.0, "power of w where A < 0 (TRL vespo_k_neg)", ge=0),
          lambda_neg=Float(2.0, "decay of w where A < 0 (TRL vespo_lambda_neg)", ge=1e-4))
def gamma_weight(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, k_pos: float,
                 lambda_pos: float, k_neg: float, lambda_neg: float) -> Tensor:
    """VESPO's weight: a Gamma-density shape of the (sequence) ratio, 1 at rho = 1, instead of a clip.

    formula: phi(w) = exp(lam + k log w - lam w),  log w = clamp(log rho, log 1e-8, 20);  k, lam = ({k_pos}, {lambda_pos}) if A >= 0 else ({k_neg}, {lambda_neg})
    source: VESPO (arXiv 2602.10693); TRL loss_type="vespo" (get_gamma_weights): pair with
      `ratio product(clamp=20.0)` and `objective is_weighted` (-sg(phi) A log pi)
    shapes: [B, T] -> [B, T]
    edge cases: phi peaks at w = k/lam and decays to 0 both ways; an overflow or NaN of phi
      becomes 0 (TRL nan_to_num), so the weight is always finite.
    """
    log_w = torch.clamp(torch.log(rho), _LOG_MIN_W, 20.0)
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(rho, k_pos), torch.full_like(rho, k_neg))
    lam = torch.where(pos, torch.full_like(rho, lambda_pos), torch.full_like(rho, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
