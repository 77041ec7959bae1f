"""Small masked tensor helpers used by components and generated code (no formulas of algorithms)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .lazy_torch import torch

if TYPE_CHECKING:
    from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) over all elements, with padding set to 0 first (so inf/NaN padding is harmless)."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).mul(mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def token_covariance(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """(A - mean_m A) (log pi - mean_m log pi) per token [B, T], no gradient, means over the
    valid tokens; 0 on padding."""
    valid = mask > 0
    a = torch.where(valid, adv.detach(), 0.0)
    lp = torch.where(valid, logp.detach(), 0.0)
    n = mask.sum().clamp_min(1)
    cov = (a - a.sum() / n) * (lp - lp.sum() / n)
    return torch.where(valid, cov, 0.0)


def group_view(x: Tensor, group_size: int) -> Tensor:
    """[B] -> [P, G] (groups are contiguous rows)."""
    if x.shape[0] % group_size:
        raise ValueError(f"batch of {x.shape[0]} rows is not a whole number of groups of {group_size}")
    return x.view(-1, group_size)


def moments(x: Tensor, valid: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, std and count of ``x`` over its last dim, counting only ``valid`` entries.

    x, valid [..., N] -> mean, std, count [..., 1]. The std is Bessel's (N-1) when
    ``unbiased``; with fewer than 2 valid entries it is taken as 1 (verl's singleton rule).
    Invalid entries (e.g. a sample whose reward function failed) are simply not there, like
    TRL's nanmean / nanstd.
    """
    v = valid.to(x.dtype)
    k = v.sum(-1, keepdim=True)  # [..., 1]
    mean = (x * v).sum(-1, keepdim=True) / k.clamp_min(1)
    ss = (((x - mean) * v) ** 2).sum(-1, keepdim=True)
    denom = (k - 1) if unbiased else k
    std = torch.sqrt(ss / denom.clamp_min(1))
    if unbiased:
        std = torch.where(k < 2, torch.ones_like(std), std)
    return mean, std, k


def keyed_groups(keys: Tensor) -> tuple[Tensor, int]:
    """[B] int keys -> (the group of each row [B] long, 0 .. K-1 in ascending key order; K).

    The groups of ``group_by=FIELD``: rows with equal keys (``group_keys``) form one group,
    wherever they are in the batch (across prompts)."""
    uniq, inv = torch.unique(keys.reshape(-1), sorted=True, return_inverse=True)
    return inv, int(uniq.numel())


def keyed_sum(x: Tensor, group: Tensor, k: int) -> Tensor:
    """[B] -> [K]: the sum of ``x`` over each group's rows, added in row order (deterministic:
    a one-hot reduction, no atomics)."""
    onehot = (group.unsqueeze(-1) == torch.arange(k, device=group.device)).to(x.dtype)  # [B, K]
    return (onehot * x.unsqueeze(-1)).sum(0)


def keyed_moments(x: Tensor, valid: Tensor, keys: Tensor,
                  unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`moments` of ``x`` [B] over the groups of ``keys`` [B], given back per row [B]:
    each row's group mean, std and count of valid rows (std 1 with fewer than 2 when
    ``unbiased``, as ``moments``)."""
    group, k = keyed_groups(keys)
    v = valid.to(x.dtype)
    n = keyed_sum(v, group, k)  # [K]
    mean = keyed_sum(x * v, group, k) / n.clamp_min(1)
    ss = keyed_sum(((x - mean[group]) * v) ** 2, group, k)
    denom = (n - 1) if unbiased else n
    std = torch.sqrt(ss / denom.clamp_min(1))
    if unbiased:
        std = torch.where(n < 2, torch.ones_like(std), std)
    return mean[group], std[group], n[group]


def masked_whiten(x: Tensor, mask: Tensor, eps: float, shift_mean: bool = True) -> Tensor:
    """``x`` [B, T] whitened over the tokens where ``mask`` is 1 (verl's masked_whiten).

    (x - mean) / sqrt(var + eps), var with Bessel's correction; ``shift_mean=False`` adds the
    mean back. With fewer than 2 tokens ``x`` is returned unchanged (verl raises).
    """
    n = mask.sum()
    if n < 2:
        return x
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n * (n / (n - 1))
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def scorable_stats(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Max, min, sum and count of the finite entries of ``rewards`` over its last dim.

    rewards [..., G] (NaN where a reward failed) -> four [...] tensors; a row without a
    finite entry has max -inf, min +inf, sum 0, count 0. A failed reward is not there
    (not a 0), as in every group statistic of the advantage stage.
    """
    finite = torch.isfinite(rewards)
    r = rewards.to(torch.float64)
    hi = torch.where(finite, r, torch.full_like(r, -float("inf"))).amax(dim=-1)
    lo = torch.where(finite, r, torch.full_like(r, float("inf"))).amin(dim=-1)
    total = torch.where(finite, r, torch.zeros_like(r)).sum(dim=-1)
    return hi, lo, total, finite.sum(dim=-1)


def last_token(values: Tensor, mask: Tensor) -> Tensor:
    """Place a per-sequence value on the last valid token: [B], [B, T] -> [B, T] (0 elsewhere)."""
    T = mask.shape[1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values  # [B]
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    rows = last >= 0
    out[rows.nonzero().squeeze(-1), last[rows]] = values[rows]
    return out


def dense_token_rewards(rewards: Tensor, dense: Tensor, mask: Tensor) -> Tensor:
    """Token rewards of dense rewards: [B], [B, T], [B, T] -> [B, T].

    Each row's dense rewards stay on their tokens (0 off the mask: a row the mask empties, such as
    one whose reward failed, gets none); the part of the sequence reward they do not account for
    (other reward terms, shaping) goes on the last valid token, so every row's token rewards sum to
    its sequence reward.
    """
    d = dense.to(rewards.dtype) * mask  # [B, T]
    return d + last_token(rewards - d.sum(-1), mask)


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
    valid          [B]     bool: the reward is real (False where the reward function failed;
                           such rows carry their group's mean reward and leave every statistic)
    reward_baselines [B]   reward of a greedy rollout of each row's prompt (None unless a
                           component needs it: `baseline greedy_reward`)
    old_logprobs   [B, T]  old-policy logprobs of the sampled tokens (None unless the baseline
                           needs them: `baseline optimal_token`)
    sum_pi_squared [B, T]  sum_v pi_v^2 of the old policy at each response token (None unless
                           a component needs it: `baseline optimal_token`)
    reward_components [B, K] each reward function's own reward (None unless a component needs
                           it: `baseline per_reward_group`); reward_weights [K] their weights
    inputs         dict    any other optional input a component of the batch's slots reads (the
                           table in rldsl/inputs.py), by name; ``batch.<name>`` reads it too
    """

    rewards: Tensor
    raw_rewards: Tensor
    token_rewards: Tensor
    mask: Tensor
    group_size: int
    values: Tensor | None = None
    truncated: Tensor | None = None
    state: dict[str, Tensor] = field(default_factory=dict)
    valid: Tensor | None = None
    reward_baselines: Tensor | None = None
    old_logprobs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    reward_components: Tensor | None = None
    reward_weights: Tensor | None = None
    inputs: dict[str, Tensor] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Tensor:
        """An optional input without a field of its own (``inputs``), read as ``batch.<name>``."""
        inputs = self.__dict__.get("inputs", {})
        if name in inputs:
            return inputs[name]
        raise AttributeError(f"AdvantageBatch has no field or input {name!r}")

    @property
    def valid_rows(self) -> Tensor:
        """[B] bool: rows with a real reward (all rows unless ``valid`` says otherwise)."""
        if self.valid is None:
            return torch.ones(self.rewards.shape, dtype=torch.bool, device=self.rewards.device)
        return self.valid.to(torch.bool)

    @property
    def lengths(self) -> Tensor:
        """[B] number of response tokens."""
        return self.mask.sum(-1)


def rejection_metrics(keep: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The correction slot's rejected fractions: valid tokens, and non-empty rows with a rejected token."""
    gone = (1 - keep) * mask
    rows = (mask.sum(-1) > 0).to(mask.dtype)
    return {"correction/rejected_fraction": gone.sum() / mask.sum().clamp(min=1.0),
            "correction/rejected_seq_fraction": ((gone.sum(-1) > 0).to(mask.dtype)).sum() / rows.sum().clamp(min=1.0)}
