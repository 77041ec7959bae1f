"""objective: the per-token surrogate loss (minimised).

Signature: ``(w [B, T], adv [B, T], logp [B, T]) -> loss [B, T]``.
"""
from __future__ import annotations

from torch import Tensor

from ..registry import register


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
