"""filter: samples removed from the loss (their mask rows are zeroed; metrics still see them).

Signature: ``(batch: AdvantageBatch) -> keep [B]`` (float 0/1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..ops import AdvantageBatch, group_view, scorable_stats
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("filter", off=True)
def none(batch: AdvantageBatch) -> Tensor:
    """Keep every sample.

    formula: keep_i = 1
    source: -
    shapes: -> [B]
    """
    return torch.ones_like(batch.rewards)


@register("filter", needs=("truncated",))
def overlong(batch: AdvantageBatch) -> Tensor:
    """Mask samples that were truncated at the generation limit (no EOS).

    formula: keep_i = 0 if o_i hit max_new_tokens else 1
    source: DAPO overlong filtering (Yu et al. 2025); TRL mask_truncated_completions=True;
      ROLL max_len_mask
    shapes: truncated [B] -> [B]
    """
    if batch.truncated is None:
        raise ValueError("filter overlong needs truncated= (which samples hit max_new_tokens)")
    return (~batch.truncated.to(torch.bool)).to(batch.rewards.dtype)


@register("filter", per_group=True)
def zero_variance(batch: AdvantageBatch) -> Tensor:
    """Mask every sample of a group whose rewards are all equal (no learning signal).

    formula: keep_i = 1[max_{g(i)} r != min_{g(i)} r]
    source: ScaleRL zero-variance filtering (Khatri et al. 2025); DAPO dynamic sampling's
      criterion; verl filter_groups (std == 0); ROLL std_filter
    shapes: r [B] -> [B]
    edge cases: uses the raw verifier rewards (before shaping), so a length penalty does
      not make a constant-outcome group look informative.
    """
    r = group_view(batch.raw_rewards, batch.group_size)  # [P, G]
    mixed = r.amax(dim=1) != r.amin(dim=1)  # [P]
    return mixed.repeat_interleave(batch.group_size).to(batch.rewards.dtype)


@register("filter", plan={"pass_rate_cap": "max"},
          max=Float(0.9, "pass rate at or above which a prompt is retired", gt=0, le=1))
def pass_rate_cap(batch: AdvantageBatch, max: float) -> Tensor:
    """Retire prompts whose pass rate reaches ``max`` from later epochs (carried out by the runtime).

    formula: prompt p leaves later epochs if pass(p) >= {max}, pass(p) = mean of its group's
      scorable rewards (a failed reward, NaN, is not counted as 0); in this batch keep_i = 1
    source: ScaleRL No-Positive-Resampling (Khatri et al. 2025: prompts with pass rate >= 0.9
      are not sampled again)
    shapes: -> [B]; the runtime's rule: retired(rewards [P, G], max) -> [P] bool
    edge cases: a group with no scorable reward has no pass rate and is never retired.
    """
    return torch.ones_like(batch.rewards)


def pass_rates(rewards: Tensor) -> Tensor:
    """[P, G] rewards (NaN = failed) -> [P] float64 mean scorable reward (NaN: none scorable)."""
    _, _, total, count = scorable_stats(rewards)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))


def retired(rewards: Tensor, max: float) -> Tensor:
    """[P, G] -> [P] bool: pass rate >= ``max`` (``pass_rate_cap``'s rule; 1e-9 absorbs rounding)."""
    return pass_rates(rewards) >= max - 1e-9
