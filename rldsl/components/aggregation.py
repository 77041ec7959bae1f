"""aggregation: how per-token losses become one scalar, with exact denominators.

Signature: ``(mask [B, T], group_size) -> (weights [B, T], count [])``; the loss is
``sum(l * weights) / count``. Every aggregation is linear, so micro-batches and ranks get the
exact big-batch loss by summing their local counts and passing the total as ``denominator``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..ops import group_view
from ..registry import Bool, Int, register

if TYPE_CHECKING:
    from torch import Tensor

COUNT_EMPTY = Bool(False, "count fully masked rows in the number of sequences (verl in-trainer)")


@register("aggregation")
def token_mean(mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Mean over every response token of the (mini-)batch.

    formula: L = sum_it m_it l_it / sum_it m_it
    source: DAPO (Yu et al. 2025) token-level loss; Lite PPO; verl loss_agg_mode=token-mean
      (default); TRL loss_type="dapo"/"bnpo"
    shapes: [B, T] -> weights [B, T], count []
    """
    return mask, mask.sum()


@register("aggregation", count_empty=COUNT_EMPTY)
def seq_mean_token_mean(mask: Tensor, group_size: int, count_empty: bool) -> tuple[Tensor, Tensor]:
    """Mean over sequences of each sequence's token mean.

    formula: L = (1/N) sum_i (1/|o_i|) sum_t m_it l_it,  N = #{i : |o_i| > 0} (all rows if count_empty)
    source: GRPO paper (Shao et al. 2024); verl seq-mean-token-mean; TRL loss_type="grpo"
    shapes: [B, T] -> weights [B, T], count []
    """
    L = mask.sum(-1, keepdim=True)  # [B, 1]
    n = torch.full_like(mask.sum(), mask.shape[0]) if count_empty else (L > 0).sum().to(mask.dtype)
    return mask / L.clamp_min(1), n


@register("aggregation", count_empty=COUNT_EMPTY)
def seq_mean_token_sum(mask: Tensor, group_size: int, count_empty: bool) -> tuple[Tensor, Tensor]:
    """Mean over sequences of each sequence's token sum (the REINFORCE sequence log-likelihood).

    formula: L = (1/N) sum_i sum_t m_it l_it,  N = #{i : |o_i| > 0} (all rows if count_empty)
    source: REINFORCE; verl seq-mean-token-sum
    shapes: [B, T] -> weights [B, T], count []
    """
    L = mask.sum(-1)
    n = torch.full_like(mask.sum(), mask.shape[0]) if count_empty else (L > 0).sum().to(mask.dtype)
    return mask, n


@register("aggregation", roles={"budget": "max_tokens"}, max_tokens=Int(doc="the constant L_max (generation budget)", ge=1))
def token_sum_norm(mask: Tensor, group_size: int, max_tokens: int) -> tuple[Tensor, Tensor]:
    """Token sum divided by a constant: no length normalisation (Dr. GRPO).

    formula: L = sum_it m_it l_it / (B * {max_tokens})
    source: Dr. GRPO (Liu et al. 2025); verl seq-mean-token-sum-norm with
      loss_scale_factor={max_tokens}; TRL loss_type="dr_grpo" (max_completion_length)
    shapes: [B, T] -> weights [B, T], count [] (= B: every sequence counts)
    """
    return mask / max_tokens, torch.full_like(mask.sum(), mask.shape[0])


@register("aggregation", needs=("group_size",))
def prompt_mean(mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Token mean within each prompt's group, then mean over prompts.

    formula: L = (1/P') sum_g (1/sum_{i in g} |o_i|) sum_{i in g} sum_t m_it l_it,  P' = #{g : sum |o_i| > 0}
    source: ScaleRL prompt-level loss averaging (Khatri et al. 2025)
    shapes: [B, T] -> weights [B, T], count []
    """
    Lg = group_view(mask.sum(-1), group_size).sum(-1)  # [P]
    per_row = Lg.repeat_interleave(group_size).unsqueeze(-1)  # [B, 1]
    return mask / per_row.clamp_min(1), (Lg > 0).sum().to(mask.dtype)


@register("aggregation")
def token_sum(mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Sum over every response token, no denominator.

    formula: L = sum_it m_it l_it
    source: verl loss_agg_mode=token-sum
    shapes: [B, T] -> weights [B, T], count [] (= 0: no denominator)
    edge cases: the count is 0 and the loss divides by max(count, 1) = 1, so local counts summed
      over micro-batches or ranks (docs/api.md, "Denominators") still give the plain sum; the
      loss grows with the batch size and the response lengths.
    """
    return mask, torch.zeros_like(mask.sum())
