"""shaping: reward transforms applied before the advantage.

Signature: ``(rewards [B], batch: AdvantageBatch) -> rewards [B]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..ops import AdvantageBatch
from ..registry import Float, Int, register

if TYPE_CHECKING:
    from torch import Tensor


@register("shaping", off=True)
def none(rewards: Tensor, batch: AdvantageBatch) -> Tensor:
    """Rewards unchanged.

    formula: r_i
    source: -
    shapes: [B] -> [B]
    """
    return rewards


@register("shaping", roles={"budget": "max_len"},
          max_len=Int(doc="L_max: the generation budget in tokens", ge=1),
          cache=Int(doc="L_cache: the soft-penalty buffer before L_max", ge=1),
          factor=Float(1.0, "penalty at L_max", ge=0))
def overlong_penalty(rewards: Tensor, batch: AdvantageBatch, max_len: int, cache: int,
                     factor: float) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward.

    formula: r_i += 0 if L_i <= {max_len} - {cache};  {factor} ((({max_len} - {cache}) - L_i) / {cache}) if L_i <= {max_len};  -{factor} beyond
    source: DAPO (Yu et al. 2025, eq. 13); verl DAPORewardManager overlong_buffer
      (len = cache, penalty_factor = factor)
    shapes: [B] -> [B]
    """
    L = batch.lengths.to(rewards)
    start = max_len - cache
    pen = torch.clamp((start - L) / cache, min=-1.0, max=0.0) * factor
    return rewards + pen
