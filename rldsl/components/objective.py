"""objective: the per-token surrogate loss (minimised).

Signature: ``(w [B, T], adv [B, T], logp [B, T], mask [B, T]) -> loss [B, T]``. The mask is
there for an objective that takes statistics over the valid tokens (kl_cov's covariance).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import ops
from ..lazy_torch import torch
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("objective", uses_ratio=True)
def ppo(w: Tensor, adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Importance-weighted surrogate: gradient flows through the (trust-region) weight.

    formula: l_it = -A_it w_it
    source: PPO (Schulman et al. 2017); verl compute_policy_loss_vanilla; TRL loss_type=grpo/dapo/...
    shapes: [B, T] -> [B, T]
    """
    return -adv * w


@register("objective", uses_ratio=False)
def reinforce(w: Tensor, adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Plain policy gradient, no ratio.

    formula: l_it = -A_it log pi(o_it)
    source: REINFORCE (Williams 1992); verl loss_mode=gpg
    shapes: [B, T] -> [B, T]
    """
    return -adv * logp


@register("objective", uses_ratio=True)
def is_weighted(w: Tensor, adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE with a stopped-gradient importance weight (CISPO, DPPO).

    formula: l_it = -sg(w_it) A_it log pi(o_it)
    source: CISPO (MiniMax-M1 2025); DPPO (Qi et al. 2026); verl loss_mode=cispo/dppo_tv/dppo_kl
    shapes: [B, T] -> [B, T]
    """
    return -w.detach() * adv * logp


@register("objective", uses_ratio=True, beta=Float(doc="weight of the squared log ratio (verl policy_loss.dro_beta)", gt=0))
def dro(w: Tensor, adv: Tensor, logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """REINFORCE with a quadratic penalty on the log ratio to the old policy (DRO).

    formula: l_it = -(A_it log pi(o_it) - {beta}/2 (log w_it)^2),  w = rho with `trust_region none`
    source: DRO (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for LLM
      Alignment", arXiv 2405.19107); verl loss_mode=dro (-(log pi A - 0.5 dro_beta log_ratio^2))
    shapes: [B, T] -> [B, T]
    edge cases: the penalty acts on every response token, also where A = 0; verl does not clamp
      the log ratio: give the ratio a clamp beyond any reachable value (80 keeps exp finite in
      float32) to match it.
    """
    return -(adv * logp - 0.5 * beta * torch.log(w) ** 2)


@register("objective", uses_ratio=True,
          ratio=Float(0.0002, "the share of valid tokens (at least one) with the largest covariance that get "
                              "the penalty (verl kl_cov_ratio)", gt=0, le=1),
          coef=Float(0.1, "weight of |log rho| on them (verl ppo_kl_coef, 0.1 in its actor config)", ge=0))
def kl_cov(w: Tensor, adv: Tensor, logp: Tensor, mask: Tensor, ratio: float, coef: float) -> Tensor:
    """KL-Cov: the surrogate plus a |log rho| penalty on the tokens of largest covariance.

    formula: l_it = -A_it w_it + {coef} |log w_it| 1[(i,t) in top_n cov],  w = rho with `trust_region none`;
      cov_it = (A_it - mean_m A) (log pi(o_it) - mean_m log pi) over valid tokens,
      n = max(1, floor({ratio} sum m)) (torch.topk, largest)
    source: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
      Language Models", arXiv 2505.22617; verl loss_mode=kl_cov (kl_cov_ratio 2e-4, ppo_kl_coef 0.1,
      no clip, no log-ratio clamp: `ratio token(clamp=80.0)`)
    shapes: w, adv, logp, mask [B, T] -> [B, T]
    edge cases: no valid token: no penalty; the covariance is over this call's valid tokens
      (verl: its micro-batch); the penalty's gradient is sign(log rho), 0 at rho = 1.
    """
    valid = mask > 0
    sel = torch.zeros_like(logp)
    cov = ops.token_covariance(adv, logp, mask)[valid]  # valid tokens, row-major as verl's
    if cov.numel() > 0:
        n = max(1, int(cov.numel() * ratio))
        flat = torch.nonzero(valid.reshape(-1)).squeeze(-1)[torch.topk(cov, n).indices]
        sel = sel.reshape(-1).index_fill(0, flat, 1.0).reshape(logp.shape)
    return -adv * w + coef * torch.abs(torch.log(w)) * sel
