"""critic: the value model's loss (used by the gae baseline).

Signature: ``(values [B, T], old_values [B, T] | None, returns [B, T]) -> value_loss [B, T]``,
aggregated by the critic's own ``aggregation`` (an aggregation component; verl's critic
has its own loss_agg_mode, token-mean by default) and scaled by ``coef``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Choice, Float, register

if TYPE_CHECKING:
    from torch import Tensor

# aggregations whose parameters all have defaults (the critic names one; defaults apply)
VALUE_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "prompt_mean")


@register("critic", off=True)
def none(values: Tensor, old_values: Tensor | None, returns: Tensor) -> Tensor:
    """No critic.

    formula: 0
    source: critic-free methods (GRPO, RLOO, ...)
    shapes: -> [B, T]
    """
    return torch.zeros_like(returns)


@register("critic", needs=("values", "returns"), provides=("values",),
          clip=Float(0.5, "values move at most this far from the rollout-time values", gt=0),
          coef=Float(1.0, "scale of the value loss", gt=0, runtime=True),
          aggregation=Choice(VALUE_AGGREGATIONS, "token_mean",
                             "how the per-token value loss becomes one scalar (an aggregation "
                             "component; the policy's own is separate)", runtime=True))
def value(values: Tensor, old_values: Tensor | None, returns: Tensor, clip: float) -> Tensor:
    """Clipped value regression towards the GAE returns.

    formula: l^V_it = 0.5 max((V - R)^2, (V_old + clamp(V - V_old, -{clip}, {clip}) - R)^2);
      value_loss = {coef} * {aggregation}(l^V)
    source: PPO for RLHF; verl compute_value_loss (cliprange_value 0.5; critic
      loss_agg_mode token-mean by default, independent of the actor's)
    shapes: [B, T] -> [B, T]
    edge cases: without old_values the unclipped 0.5 (V - R)^2 is used.
    """
    err = (values - returns) ** 2
    if old_values is None:
        return 0.5 * err
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum(err, (clipped - returns) ** 2)
