"""correction: the train/inference mismatch between the engine that sampled and the trainer.

Signature: ``(old_logp [B, T], rollout_logp [B, T], mask [B, T]) -> (weight [B, T], keep [B, T],
metrics)``. log r = old_logp - rollout_logp (pi_old recomputed by the trainer over the engine's
logprobs; a NaN rollout logprob counts as log r = 0, ratio 1). ``keep`` (0/1) leaves the loss
mask, denominator included: ``estimate(rollout_logprobs=...)`` applies it to ``est.mask`` and
``loss()`` applies it again (idempotent). ``weight`` (no gradient) multiplies the per-token
policy loss after the trust region, not the KL or entropy terms. Several components are ANDed
(keeps) and multiplied (weights); each one sees the mask the call receives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Bool, Choice, Float, register

if TYPE_CHECKING:
    from torch import Tensor

_M = "correction/"


def log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi_old / pi_rollout) on valid tokens; 0 on padding and where either side is NaN."""
    x = old_logp.detach() - rollout_logp.detach()
    return torch.where((mask > 0) & ~torch.isnan(x), x, torch.zeros_like(x))


def mismatch_metrics(x: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """mismatch_kl = mean_m(log pi_rollout - log pi_old) (k1 of KL(rollout || old)) and its k3."""
    n = mask.sum().clamp(min=1.0)
    xc = x.clamp(-20.0, 20.0)
    return {_M + "mismatch_kl": (-x * mask).sum() / n,
            _M + "mismatch_k3": ((torch.exp(xc) - 1 - xc) * mask).sum() / n}


def _row_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum(-1, keepdim=True)  # [B, 1]


@register("correction", off=True)
def none(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """No correction: the engine's samples are treated as the trainer's own.

    formula: w_it = 1, keep_it = 1
    source: -
    shapes: -> [B, T], [B, T]
    """
    one = torch.ones_like(mask)
    return one, one, {}


@register("correction", needs=("rollout_logprobs",), roles={"weight_low": "low", "weight_high": "high"},
          level=Choice(("token", "sequence", "geometric"), "token",
                       "one weight per token, per sequence (product) or per sequence (geometric mean)"),
          mode=Choice(("truncate", "mask"), "truncate",
                      "truncate: min(w, high) (TIS); mask: w = 0 outside [low, high] (MIS, IcePop)"),
          high=Float(2.0, "upper bound of the weight", gt=0),
          low=Float(None, "lower bound of the weight (truncate: max(w, low); mask: the band's low end)", ge=0),
          normalize=Bool(False, "divide by the batch mean of the weights (mean 1)"),
          clamp=Float(20.0, "|log w| is clamped to it before exp", gt=0))
def importance(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str, mode: str, high: float,
               low: float | None, normalize: bool, clamp: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights pi_old / pi_rollout that multiply the per-token policy loss.

    formula: log r_it = log pi_old(o_it) - log pi_rollout(o_it)  (NaN -> 0)
      token: w_it = exp(clip(log r_it, +-{clamp})); sequence: w_i = exp(clip(sum_t m log r, +-{clamp}));
      geometric: w_i = exp(clip(sum_t m log r / |o_i|, +-{clamp}))
      truncate: w = min(w, {high}), then max(w, low) if low is given;
      mask: w = w 1[w <= {high}] 1[w >= low if low is given]
      normalize: w /= mean_m(w) (token) or the mean of the row means (sequence), if > 1e-8
    source: TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
      RL training"); IcePop (Ling team 2025, "Small leak can sink a great ship"); verl
      algorithm.rollout_correction rollout_is=token|sequence, rollout_is_threshold (a float:
      truncate; "lo_hi": mask), rollout_is_batch_normalize (SAFETY_BOUND 20); TRL
      vllm_importance_sampling_mode token_truncate|token_mask|sequence_truncate|sequence_mask
      with vllm_importance_sampling_clip_min / _clip_max (no clamp: clamp=80)
    shapes: old_logp, rollout_logp, mask [B, T] -> w [B, T] (0 on padding), keep = 1
    edge cases: an empty row gets w = 0 and leaves the normalising mean; the metrics
      correction/is_mean, is_max, is_min and ess (1 / mean_m (w / mean_m w)^2) are taken on
      the weights the loss uses; mode=mask adds masked_fraction (valid tokens with w = 0).
    """
    m = mask
    x = log_ratio(old_logp, rollout_logp, m)
    if level == "token":
        lw = x
    elif level == "sequence":
        lw = _row_sum(x, m).expand_as(x)
    else:
        lw = (_row_sum(x, m) / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(x)
    w = torch.exp(lw.clamp(-clamp, clamp)) * m
    if mode == "truncate":
        w = w.clamp(max=high)
        if low is not None:
            w = w.clamp(min=low) * m
    else:
        inside = w <= high
        if low is not None:
            inside = inside & (w >= low)
        w = torch.where(inside, w, torch.zeros_like(w))
    n = m.sum().clamp(min=1.0)
    masked = ((w == 0) & (m > 0)).to(m.dtype).sum() / n if mode == "mask" else None
    if normalize:
        if level == "token":
            mean = (w * m).sum() / n
        else:
            n_row = m.sum(-1)
            rows = (n_row > 0).to(w.dtype)
            row_mean = (w * m).sum(-1) / n_row.clamp(min=1.0)
            mean = (row_mean * rows).sum() / rows.sum().clamp(min=1.0)
        w = torch.where(mean > 1e-8, w / torch.where(mean > 1e-8, mean, torch.ones_like(mean)), w)
    w = w.detach()
    valid = m > 0
    mean_w = (w * m).sum() / n
    metrics = {_M + "is_mean": mean_w,
               _M + "is_max": torch.where(valid, w, torch.full_like(w, -float("inf"))).max(),
               _M + "is_min": torch.where(valid, w, torch.full_like(w, float("inf"))).min(),
               _M + "ess": 1.0 / (((w / (mean_w + 1e-8)) ** 2 * m).sum() / n).clamp(min=1e-12)}
    if masked is not None:
        metrics[_M + "masked_fraction"] = masked  # weights set to 0 (the tokens stay in the count)
    metrics.update(mismatch_metrics(x, m))
    return w, torch.ones_like(m), metrics


_STATS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
          "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@register("correction", needs=("rollout_logprobs",),
          stat=Choice(_STATS, "seq_mean_k3", "the mismatch statistic: per token, or per sequence (sum, mean, max)"),
          high=Float(0.01, "upper bound (k1: the ratio's, log taken; k2/k3: the statistic's)", gt=0),
          low=Float(None, "k1 only: lower bound of the ratio (default 1/high)", gt=0))
def reject(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, stat: str, high: float,
           low: float | None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Rejection: tokens or whole sequences whose mismatch statistic is out of bounds leave the loss.

    formula: x_it = clip(log pi_old - log pi_rollout, +-20); k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x
      {stat}: per token, or per sequence: sum_t m k, sum_t m k / |o_i|, max_t m k (0 if empty)
      k1: keep = 1[log(low) <= {stat} <= log({high})] (low defaults to 1/high);
      k2, k3: keep = 1[{stat} <= {high}]
    source: verl algorithm.rollout_correction rollout_rs (token_k1 ... seq_max_k3) with
      rollout_rs_threshold ("lo_hi" for k1); MIS/geometric rejection (Liu, Li et al. 2025,
      "When speed kills stability"); decoupled_geo_rs is seq_mean_k1 with 0.999_1.001
    shapes: old_logp, rollout_logp, mask [B, T] -> w = 1, keep [B, T] 0/1
    edge cases: the slot reports correction/rejected_fraction (of valid tokens) and
      rejected_seq_fraction (of non-empty rows with a rejected token) for all its keeps together
    """
    m = mask
    raw = log_ratio(old_logp, rollout_logp, m)
    x = raw.clamp(-20.0, 20.0)
    kind = stat[-2:]
    k = -x if kind == "k1" else (x * x / 2 if kind == "k2" else torch.exp(x) - 1 - x)
    if stat.startswith("token_"):
        s = k
    elif stat.startswith("seq_sum_"):
        s = _row_sum(k, m).expand_as(k)
    elif stat.startswith("seq_mean_"):
        s = (_row_sum(k, m) / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(k)
    else:
        s = torch.where(m > 0, k, torch.zeros_like(k)).amax(-1, keepdim=True).clamp(min=0.0).expand_as(k)
    if kind == "k1":
        lo = torch.log(torch.as_tensor(low if low is not None else 1.0 / high, dtype=k.dtype))
        keep = (s >= lo) & (s <= torch.log(torch.as_tensor(high, dtype=k.dtype)))
    else:
        keep = s <= high
    return torch.ones_like(m), keep.to(m.dtype), mismatch_metrics(raw, m)


@register("correction", needs=("rollout_logprobs",), old_from_rollout=True)
def bypass(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Bypass: the old policy is the rollout policy; its logprobs are not recomputed.

    formula: log pi_old(o_it) := log pi_rollout(o_it) (where the engine gave one); w_it = 1, keep_it = 1;
      the other corrections then compare sg(pi_theta) with pi_rollout, in loss() only
    source: verl algorithm.rollout_correction.bypass_mode=true (old_log_prob = rollout_log_prob;
      rollout_is / rollout_rs on pi_current vs pi_rollout inside the loss): loss_type "ppo_clip"
      is `objective ppo` + verl's clip and no `importance`; "reinforce" (-sg(w) A log pi,
      w = pi_theta / pi_rollout truncated) is `objective reinforce` + `importance(high=...)`
    shapes: old_logp, rollout_logp, mask [B, T] -> w = 1, keep = 1
    edge cases: estimate() applies no rejection (it has no pi_theta); a NaN engine logprob keeps
      the given old logprob (the runtime passes sg(pi_theta): ratio 1 there). The runtime skips
      its old-logprob forward.
    """
    one = torch.ones_like(mask)
    return one, one, {}
