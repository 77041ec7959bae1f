"""selection: which tokens keep their policy loss (the KL and entropy terms are untouched).

Signature: ``(adv, logp, old_logp, rollout_logp, entropy, mask) -> keep [B, T]`` (0/1, no
gradient), applied as ``pg * keep`` before the KL and entropy terms are added. The
aggregation's denominator is unchanged, as TRL multiplies its per-token loss and keeps
``completion_mask`` as the denominator; a selection never edits ``est.mask``. Several
selections are ANDed. ``rollout_logp`` is None when ``loss()`` got no ``rollout_logprobs``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Float, register


@register("selection", off=True)
def all(adv: Tensor, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None, entropy: Tensor | None,
        mask: Tensor) -> Tensor:  # noqa: A001 - the DSL name
    """Every token keeps its policy loss.

    formula: keep_it = 1
    source: -
    shapes: -> [B, T]
    """
    return torch.ones_like(mask)


@register("selection", needs=("entropy",),
          quantile=Float(1.0, "the fraction rho of valid tokens (highest entropy) that keep their loss",
                         gt=0, le=1))
def top_entropy(adv: Tensor, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None,
                entropy: Tensor | None, mask: Tensor, quantile: float) -> Tensor:
    """Only the highest-entropy tokens ("forking tokens") keep their policy-gradient loss.

    formula: tau = quantile_{1 - {quantile}}(H_it : m_it = 1)  (linear interpolation);
      keep_it = 1[H_it m_it >= tau] m_it
    source: Wang et al. 2025, "Beyond the 80/20 rule: high-entropy minority tokens drive
      effective RL for LLM reasoning" (rho = 0.2); TRL top_entropy_quantile (default 1.0)
    shapes: entropy, mask [B, T] -> [B, T]
    edge cases: quantile 1 keeps every token; the quantile is over this call's valid tokens (TRL gathers them from every
      process); a call without valid tokens keeps nothing. TRL also restricts the entropy
      bonus to the kept tokens; here the entropy term is untouched.
    """
    assert entropy is not None  # needs=("entropy",): loss() refuses a call without it
    if quantile >= 1.0:  # every token (TRL skips the mask at 1.0)
        return torch.ones_like(mask)
    valid = mask > 0
    h = entropy.detach().to(mask.dtype)
    vals = h[valid]
    if vals.numel() == 0:
        return torch.zeros_like(mask)
    tau = torch.quantile(vals, 1.0 - quantile)
    return ((h * mask >= tau) & valid).to(mask.dtype)


@register("selection", threshold=Float(0.5, "delta: the largest mean per-token KL(sampler || pi) a "
                                            "negative-advantage sequence may have", ge=0))
def off_policy_sequence(adv: Tensor, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None,
                        entropy: Tensor | None, mask: Tensor, threshold: float) -> Tensor:
    """Off-policy sequence masking: a negative-advantage sequence that drifted too far leaves the loss.

    formula: d_it = nan_to_num(log p_sampler(o_it) - sg(log pi_theta(o_it)), nan=0);
      keep_i = 1[A_i >= 0 or sum_t m d / max(1, |o_i|) <= {threshold}]
      (p_sampler: the rollout logprobs when loss() gets them, else the old logprobs)
    source: DeepSeek-V3.2 (2025) off-policy sequence masking, eq. 9; TRL
      off_policy_mask_threshold (None = off)
    shapes: adv, logp, old_logp, rollout_logp, mask [B, T] -> [B, T]
    edge cases: A_i is the row's mean advantage over its valid tokens (one value per
      sequence for outcome rewards); an empty row keeps nothing to keep.
    """
    sampler = old_logp if rollout_logp is None else rollout_logp
    d = torch.nan_to_num(sampler.detach() - logp.detach(), nan=0.0)
    n = mask.sum(-1, keepdim=True)
    drift = (d * mask).sum(-1, keepdim=True) / n.clamp(min=1.0)
    a = (adv * mask).sum(-1, keepdim=True)
    keep = (a >= 0) | (drift <= threshold)
    return keep.to(mask.dtype).expand_as(mask) * mask
