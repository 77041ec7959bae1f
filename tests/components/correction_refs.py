"""Independent references for the correction and selection slots, transcribed from the peers' source
semantics: verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``, SAFETY_BOUND 20; the weights multiply ``pg_losses`` in
``compute_policy_loss_vanilla``, the rejection edits ``response_mask`` before the loss) and TRL
``grpo_trainer.py`` (``vllm_importance_sampling_mode``, ``..._clip_min``/``_clip_max``; the ratio
multiplies ``per_token_loss``; ``get_high_entropy_mask``, ``get_off_policy_mask``). Plain torch; nothing here calls an rldsl component.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from peer_refs import verl_agg_loss, verl_masked_mean, verl_masked_sum

SAFETY_BOUND = 20.0


def verl_is_weights(old_log_prob, rollout_log_prob, response_mask, rollout_is="token",
                    rollout_is_threshold=2.0, threshold_lower=None, batch_normalize=False) -> Tensor:
    """A float threshold truncates (TIS); with ``threshold_lower`` ("lo_hi") weights outside the
    band are zeroed (IcePop)."""
    log_ratio = old_log_prob - rollout_log_prob
    if rollout_is == "token":
        w = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        s = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(s, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    w = w * response_mask
    if threshold_lower is None:
        w = w.clamp(max=rollout_is_threshold)
    else:
        w = w.masked_fill((w > rollout_is_threshold) | (w < threshold_lower), 0.0)
    w = w.detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = verl_masked_mean(w, response_mask)
        else:
            seq_w = verl_masked_mean(w, response_mask, axis=-1)
            seq_mask = (response_mask.sum(-1) > 0).to(w.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_rs_mask(old_log_prob, rollout_log_prob, response_mask, rollout_rs: str, threshold: float,
                 threshold_lower=None) -> Tensor:
    """The modified response mask of rejection by a k1/k2/k3 statistic (token, seq sum/mean/max)."""
    x = torch.clamp(old_log_prob - rollout_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    kind = rollout_rs[-2:]
    k = {"k1": -x, "k2": 0.5 * x ** 2, "k3": torch.exp(x) - 1 - x}[kind]
    if rollout_rs.startswith("token_"):
        stat = k
    elif rollout_rs.startswith("seq_sum_"):
        stat = verl_masked_sum(k, response_mask, axis=-1).unsqueeze(-1)
    elif rollout_rs.startswith("seq_mean_"):
        stat = (verl_masked_sum(k, response_mask, axis=-1) / response_mask.sum(-1).clamp(min=1)).unsqueeze(-1)
    else:
        stat = torch.where(response_mask.bool(), k, torch.zeros_like(k)).max(dim=-1, keepdim=True).values
    if kind == "k1":
        lo = threshold_lower if threshold_lower is not None else 1.0 / threshold
        keep = (stat >= math.log(lo)) & (stat <= math.log(threshold))
    else:
        keep = stat <= threshold
    return response_mask * keep.expand_as(x).to(response_mask.dtype)


def verl_ppo_loss(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None,
                  clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0) -> Tensor:
    """compute_policy_loss_vanilla (dual clip) with the rollout weights on pg_losses, token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-advantages * clip_ratio_c, c1)
    pg = torch.where(advantages < 0, c2, c1)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    return verl_agg_loss(pg, response_mask, "token-mean")


def verl_corrected(b: dict, is_kw: dict | None = None, rs: list[dict] = ()) -> Tensor:
    """The decoupled pipeline: weights and rejections from old vs rollout, then the loss."""
    mask = b["mask"]
    w = verl_is_weights(b["old"], b["roll"], mask, **is_kw) if is_kw is not None else None
    for r in rs:
        mask = mask * verl_rs_mask(b["old"], b["roll"], b["mask"], **r)
    return verl_ppo_loss(b["old"], b["logp"], b["adv"], mask, w)


def trl_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode="sequence_mask",
                 clip_min=None, clip_max=3.0) -> Tensor:
    """vllm_importance_sampling_ratio; NaN sampling logprobs give log ratio 0."""
    diff = torch.nan_to_num(old_per_token_logps - sampling_per_token_logps, nan=0.0) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        ratio = ratio.masked_fill(ratio > clip_max, 0.0)
        if clip_min is not None:
            ratio = ratio.masked_fill(ratio < clip_min, 0.0)
    return ratio


def trl_corrected(b: dict, **kw) -> Tensor:
    """loss_type="dapo", epsilon 0.2, one process: -min(r A, clip(r) A) * is_ratio, token mean."""
    coef_1 = torch.exp(b["logp"] - b["old"])
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    a = b["a"].unsqueeze(1)
    ptl = -torch.min(coef_1 * a, coef_2 * a) * trl_is_ratio(b["old"], b["roll"], b["mask"], **kw)
    return (ptl * b["mask"]).sum() / b["mask"].sum().clamp(min=1.0)


# =========================================================================== TRL token selection
# grpo_trainer.py: get_high_entropy_mask (top_entropy_quantile) and get_off_policy_mask
# (off_policy_mask_threshold); both multiply per_token_loss, completion_mask stays the denominator


def trl_high_entropy_mask(entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """threshold = 1 - top_entropy_quantile; one process (the gather is the identity)."""
    non_pad = entropies[mask.bool()].float()
    if non_pad.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(non_pad, threshold)
    masked_entropies = entropies * mask.float()
    return (masked_entropies >= entropy_threshold) & mask.bool()


def trl_off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor,
                        mask: Tensor, off_policy_threshold: float) -> Tensor:
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    kl_div = torch.nan_to_num(kl_div, nan=0.0)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def trl_selected(b: dict, top_entropy_quantile: float = 1.0, off_policy_mask_threshold=None,
                 sampling=None) -> Tensor:
    """loss_type="dapo", epsilon 0.2, one process, the selections on per_token_loss, token mean."""
    coef_1 = torch.exp(b["logp"] - b["old"])
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    a = b["a"].unsqueeze(1)
    ptl = -torch.min(coef_1 * a, coef_2 * a)
    if top_entropy_quantile < 1.0:
        ptl = ptl * trl_high_entropy_mask(b["ent"], b["mask"], 1 - top_entropy_quantile)
    if off_policy_mask_threshold is not None:
        s = b["old"] if sampling is None else sampling
        ptl = ptl * trl_off_policy_mask(a, b["logp"], s, b["mask"], off_policy_mask_threshold)
    return (ptl * b["mask"]).sum() / b["mask"].sum().clamp(min=1.0)


def verl_bypass(b: dict, loss_type: str = "ppo_clip", is_kw: dict | None = None, rs: list[dict] = ()) -> Tensor:
    """compute_policy_loss_bypass_mode: old_log_prob = rollout_log_prob; IS weights and rejections
    from the current policy (no grad) vs the rollout; "ppo_clip" runs the vanilla loss on the
    rejected mask without IS weights, "reinforce" is -A log pi w on it (token-mean)."""
    roll, mask = b["roll"], b["mask"]
    with torch.no_grad():
        cur = b["logp"].detach()
        w = verl_is_weights(cur, roll, mask, **is_kw) if is_kw is not None else None
        eff = mask
        for r in rs:
            eff = eff * verl_rs_mask(cur, roll, mask, **r)
    if loss_type == "ppo_clip":
        return verl_ppo_loss(roll, b["logp"], b["adv"], eff)
    pg = -b["adv"] * b["logp"] * (w if w is not None else 1.0)
    return verl_agg_loss(pg, eff, "token-mean")
