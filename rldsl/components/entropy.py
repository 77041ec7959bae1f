"""entropy: a term added to the per-token loss from the policy's entropy.

Signature: ``(entropy [B, T]) -> term [B, T]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Float, register


@register("entropy", off=True)
def none(entropy: Tensor) -> Tensor:
    """No entropy term (entropy is still measured when given).

    formula: 0
    source: -
    shapes: -> [B, T]
    """
    return torch.zeros_like(entropy)


@register("entropy", needs=("entropy",), roles={"scale": "coef"}, coef=Float(doc="bonus coefficient", ge=0))
def bonus(entropy: Tensor, coef: float) -> Tensor:
    """Entropy bonus: rewards a spread-out policy.

    formula: l_it -= {coef} H_it,  H = logsumexp(z) - sum softmax(z) z
    source: PPO (Schulman et al. 2017); verl actor.entropy_coeff; TRL entropy_coef
    shapes: [B, T] -> [B, T]
    """
    return -coef * entropy
