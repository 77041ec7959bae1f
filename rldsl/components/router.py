"""router: a mixture-of-experts policy's router load-balancing (auxiliary) loss added to the
per-token loss (runtime/models/moe.py makes ``router_aux``; docs/moe.md).

Signature: ``(router_aux [B, T]) -> term [B, T]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("router", off=True)
def none(router_aux: Tensor) -> Tensor:
    """No load-balancing term (the routers' aux loss is still logged as moe/aux_loss).

    formula: 0
    source: -
    shapes: [B, T] -> [B, T] zeros
    """
    return torch.zeros_like(router_aux)


@register("router", needs=("router_aux",), roles={"scale": "coef"},
          coef=Float(doc="coefficient of the load-balancing loss", ge=0))
def balance(router_aux: Tensor, coef: float) -> Tensor:
    """The routers' load-balancing loss, coef x E sum_e f_e p_e per token (aggregated like the
    policy loss: its mean over the loss tokens is the Switch Transformer aux loss of those tokens).

    formula: l_it += {coef} a_it,  a = E sum_e f_e p_e (mean over the MoE layers)
    source: Switch Transformer (Fedus et al. 2022) load-balancing loss; transformers
      load_balancing_loss_func / router_aux_loss_coef (Mixtral 0.02, Qwen3-MoE 0.001); verl, slime
      and NeMo-RL take it from Megatron's moe_aux_loss_coeff
    shapes: [B, T] -> [B, T]
    edge cases: f_e is the micro-batch's share of picks (no gradient, as in the Switch loss); 0 for
      a dense policy (nothing to balance)
    """
    return coef * router_aux
