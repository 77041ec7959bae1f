"""selection: which tokens keep their policy loss (the KL and entropy terms are untouched).

Signature: ``(adv, logp, old_logp, rollout_logp, entropy, mask, rho, w) -> keep [B, T]`` (0/1,
no gradient), applied as ``pg * keep`` before the KL and entropy terms are added. ``rho`` and
``w`` are the ratio and the trust region's weight (None when the objective uses no ratio):
clip_cov leaves the tokens the trust region already clipped alone. The
aggregation's denominator is unchanged, as TRL multiplies its per-token loss and keeps
``completion_mask`` as the denominator; a selection never edits ``est.mask``. Several
selections are ANDed. ``rollout_logp`` is None when ``loss()`` got no ``rollout_logprobs``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import ops
from ..lazy_torch import torch
from ..registry import Float, Int, register

if TYPE_CHECKING:
    from torch import Tensor


@register("selection", off=True)
def all(adv: Tensor, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None, entropy: Tensor | None,
        mask: Tensor, rho: Tensor | None, w: Tensor | None) -> Tensor:  # noqa: A001 - the DSL name
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
                entropy: Tensor | None, mask: Tensor, rho: Tensor | None, w: Tensor | None,
                quantile: float) -> Tensor:
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
                        entropy: Tensor | None, mask: Tensor, rho: Tensor | None, w: Tensor | None,
                        threshold: float) -> Tensor:
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


@register("selection", roles={"band_low": "lb", "band_high": "ub"},
          ratio=Float(0.0002, "the share of valid tokens (at least one) whose loss is dropped (verl clip_cov_ratio)",
                      gt=0, le=1),
          lb=Float(1.0, "covariance lower bound, exclusive (verl clip_cov_lb)"),
          ub=Float(5.0, "covariance upper bound, exclusive (verl clip_cov_ub)"),
          seed=Int(0, "seed of the random choice among the candidates (same seed, same choice)", ge=0))
def clip_cov(adv: Tensor, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None, entropy: Tensor | None,
             mask: Tensor, rho: Tensor | None, w: Tensor | None, ratio: float, lb: float, ub: float,
             seed: int) -> Tensor:
    """Clip-Cov: a random few high-covariance tokens lose their policy loss (value and gradient).

    formula: cov_it = (A_it - mean_m A) (log pi(o_it) - mean_m log pi);
      candidates: m_it = 1, {lb} < cov_it < {ub}, not already clipped (w_it != rho_it and A_it != 0);
      n = max(1, floor({ratio} sum m)); keep_it = 0 on the first n candidates of a random
      permutation (torch.randperm, generator seeded with {seed}), else 1
    source: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
      Language Models", arXiv 2505.22617; verl loss_mode=clip_cov (clip_cov_ratio 2e-4,
      clip_cov_lb 1, clip_cov_ub 5): with `trust_region clip(low, high)`, `ratio token(clamp=80.0)`
      and the same permutation verl draws after torch.manual_seed({seed})
    shapes: adv, logp, mask, rho, w [B, T] -> keep [B, T]
    edge cases: no candidate (or no valid token) keeps every token; the means are over this
      call's valid tokens (verl: its micro-batch); the same seed picks the same positions in
      the candidate list at every call.
    """
    valid = mask > 0
    cov = ops.token_covariance(adv, logp, mask)
    cand = valid & (cov > lb) & (cov < ub)
    if w is not None and rho is not None:
        cand = cand & ~((w != rho) & (adv != 0))
    keep = torch.ones_like(mask)
    idx = torch.nonzero(cand)  # [K, 2], row-major as verl's
    if idx.shape[0] == 0:
        return keep
    n = max(int(ratio * float(mask.sum().item())), 1)
    perm = torch.randperm(idx.shape[0], generator=torch.Generator().manual_seed(seed))
    pick = idx[perm[:n].to(idx.device)]
    keep[pick[:, 0], pick[:, 1]] = 0.0
    return keep
