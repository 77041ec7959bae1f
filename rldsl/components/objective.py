"""objective: the per-token surrogate loss (minimised).

Signature: ``(w [B, T], adv [B, T], logp [B, T]) -> loss [B, T]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Float, register


@register("objective", uses_ratio=True)
def ppo(w: Tensor, adv: Tensor, logp: Tensor) -> Tensor:
    """Importance-weighted surrogate: gradient flows through the (trust-region) weight.

    formula: l_it = -A_it w_it
    source: PPO (Schulman et al. 2017); verl compute_policy_loss_vanilla; TRL loss_type=grpo/dapo/...
    shapes: [B, T] -> [B, T]
    """
    return -adv * w


@register("objective", uses_ratio=False)
def reinforce(w: Tensor, adv: Tensor, logp: Tensor) -> Tensor:
    """Plain policy gradient, no ratio.

    formula: l_it = -A_it log pi(o_it)
    source: REINFORCE (Williams 1992); verl loss_mode=gpg
    shapes: [B, T] -> [B, T]
    """
    return -adv * logp


@register("objective", uses_ratio=True)
def is_weighted(w: Tensor, adv: Tensor, logp: Tensor) -> Tensor:
    """REINFORCE with a stopped-gradient importance weight (CISPO, DPPO).

    formula: l_it = -sg(w_it) A_it log pi(o_it)
    source: CISPO (MiniMax-M1 2025); DPPO (Qi et al. 2026); verl loss_mode=cispo/dppo_tv/dppo_kl
    shapes: [B, T] -> [B, T]
    """
    return -w.detach() * adv * logp


@register("objective", uses_ratio=True, beta=Float(doc="weight of the squared log ratio (verl policy_loss.dro_beta)", gt=0))
def dro(w: Tensor, adv: Tensor, logp: Tensor, beta: float) -> Tensor:
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
