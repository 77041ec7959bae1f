"""ratio: the log importance ratio log(pi_theta / pi_old).

Signature: ``(logp [B, T], old_logp [B, T], mask [B, T]) -> log_ratio [B, T]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Float, register


@register("ratio", sequence_level=False,
          clamp=Float(20.0, "|log rho| is clamped to this (verl 20; large = off)", gt=0))
def token(logp: Tensor, old_logp: Tensor, mask: Tensor, clamp: float) -> Tensor:
    """Per-token ratio.

    formula: log rho_it = clamp(log pi(o_it) - log pi_old(o_it), -{clamp}, {clamp})
    source: PPO (Schulman et al. 2017); verl compute_policy_loss_vanilla (clamp 20);
      TRL importance_sampling_level="token" (no clamp)
    shapes: [B, T] -> [B, T]
    """
    return torch.clamp(logp - old_logp, -clamp, clamp)


@register("ratio", sequence_level=True, clamp=Float(10.0, "log s is clamped above at this (verl 10)", gt=0))
def sequence(logp: Tensor, old_logp: Tensor, mask: Tensor, clamp: float) -> Tensor:
    """Sequence-level ratio: the geometric mean of the token ratios, with per-token gradients.

    formula: log s_it = sg(sum_t m log rho_it / L_i) + log pi(o_it) - sg(log pi(o_it)), clamped above at {clamp}
    source: GSPO (Zheng et al. 2025); verl loss_mode=gspo; TRL importance_sampling_level="sequence"
    shapes: [B, T] -> [B, T] (the same value on every token of a row)
    """
    valid = mask > 0  # padding may hold garbage (inf): select, never multiply by 0
    lp = torch.where(valid, logp, 0.0)
    lr = torch.where(valid, logp - old_logp, 0.0)
    seq = lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)  # [B, 1]
    out = seq.detach() + lp - lp.detach()
    return torch.clamp(out, max=clamp)


@register("ratio", sequence_level=True, clamp=Float(20.0, "each token's |log rho| and the sum's are clamped to this (VESPO 20)",
                               gt=0))
def product(logp: Tensor, old_logp: Tensor, mask: Tensor, clamp: float) -> Tensor:
    """Sequence-level ratio: the product of the token ratios (the sequence likelihood ratio).

    formula: log w_i = clamp(sum_t m_it clamp(log rho_it, -{clamp}, {clamp}), -{clamp}, {clamp}), on every token of row i
    source: VESPO (arXiv 2602.10693) and TRL loss_type="vespo" (each log rho clamped to +-20,
      the sum to [log 1e-8, 20]: the lower bound is gamma_weight's); TRL RLOOTrainer (sum of
      log ratios, no clamp: a large clamp); verl rollout_is=sequence (clamp 20)
    shapes: [B, T] -> [B, T] (the same value on every token of a row)
    edge cases: the gradient is the full one of the row sum, so with seq_mean_token_mean
      aggregation the loss and gradient are those of one sequence-level term per row; padding
      values (even inf) never reach it; an empty row gives 0.
    """
    valid = mask > 0  # padding may hold garbage (inf): select, never multiply by 0
    lr = torch.where(valid, torch.clamp(logp - old_logp, -clamp, clamp), 0.0)
    seq = torch.clamp(lr.sum(-1, keepdim=True), -clamp, clamp)  # [B, 1]
    return seq.expand_as(logp)
