"""Small masked tensor helpers used by components and generated code (no formulas of algorithms)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) over all elements, with padding set to 0 first (so inf/NaN padding is harmless)."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).mul(mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def group_view(x: Tensor, group_size: int) -> Tensor:
    """[B] -> [P, G] (groups are contiguous rows)."""
    if x.shape[0] % group_size:
        raise ValueError(f"batch of {x.shape[0]} rows is not a whole number of groups of {group_size}")
    return x.view(-1, group_size)


def std(x: Tensor, dim: Any = None, unbiased: bool = True, keepdim: bool = False) -> Tensor:
    """Standard deviation; with one element the Bessel std is taken as 1 (verl's singleton rule)."""
    n = x.numel() if dim is None else x.shape[dim]
    if unbiased and n < 2:
        return torch.ones_like(x.mean(dim=dim, keepdim=keepdim) if dim is not None else x.mean())
    if dim is None:
        return x.std(correction=1 if unbiased else 0)
    return x.std(dim=dim, correction=1 if unbiased else 0, keepdim=keepdim)


def last_token(values: Tensor, mask: Tensor) -> Tensor:
    """Place a per-sequence value on the last valid token: [B], [B, T] -> [B, T] (0 elsewhere)."""
    T = mask.shape[1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values  # [B]
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    rows = last >= 0
    out[rows.nonzero().squeeze(-1), last[rows]] = values[rows]
    return out


@dataclass
class AdvantageBatch:
    """What every advantage-stage component receives (one signature per slot).

    rewards        [B]     sequence rewards after shaping and KL-in-reward
    raw_rewards    [B]     rewards as the verifier returned them
    token_rewards  [B, T]  per-token rewards: the sequence reward on the last valid token,
                           minus the KL-in-reward penalty on every token
    mask           [B, T]  response mask (float 0/1)
    group_size     G       rows g*G .. g*G+G-1 answer prompt g
    values         [B, T]  critic values (None without a critic)
    truncated      [B]     bool: the sample hit the generation limit without EOS
    state          dict    persistent state of stateful components (e.g. ema)
    """

    rewards: Tensor
    raw_rewards: Tensor
    token_rewards: Tensor
    mask: Tensor
    group_size: int
    values: Tensor | None = None
    truncated: Tensor | None = None
    state: dict[str, Tensor] = field(default_factory=dict)

    @property
    def lengths(self) -> Tensor:
        """[B] number of response tokens."""
        return self.mask.sum(-1)
