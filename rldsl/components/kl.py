"""kl: per-token estimator of KL(pi_theta || pi_ref), in the loss or in the reward.

Signature: ``(logp [B, T], ref_logp [B, T], rho [B, T]) -> kl [B, T]``. ``beta`` and
``where`` shape the generated code: ``where=loss`` adds ``beta * kl`` to the per-token loss;
``where=reward`` subtracts ``beta * kl(old, ref)`` from the rewards before the advantage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Bool, Choice, Float, register

if TYPE_CHECKING:
    from torch import Tensor

SCALE = {"scale": "beta"}  # beta 0 leaves the KL term with nothing to do
BETA = Float(doc="penalty coefficient", ge=0, runtime=True)
WHERE = Choice(("loss", "reward"), "loss", "in the loss, or subtracted from the reward", runtime=True,
               stages={"loss": "loss", "reward": "advantage"})
#: a KL term in the loss aggregated on its own (per-term aggregation): its own weights and count
#: (a second entry of ``denominator()``), added to the policy loss aggregated by the aggregation slot
AGGREGATION = Choice(("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"),
                     None, "aggregate the KL term on its own (where=loss): sum(kl * weights) / count of this "
                     "aggregation, added to the policy loss's own; absent: the aggregation slot's, one sum",
                     runtime=True, when=("where", "loss"))
NEEDS = ("old_logprobs", "ref_logprobs")  # in the reward it is computed on the old logprobs
STRAIGHT_THROUGH = Bool(False, "value of this estimator, gradient of k2 (verl's '+' suffix: k1+, k3+, abs+)")


def _straight_through(value: Tensor, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``value`` forward, the gradient of k2 = 0.5 (log pi - log pi_ref)^2 backward."""
    k2 = 0.5 * (logp - ref_logp) ** 2
    return k2 - k2.detach() + value.detach()


@register("kl", off=True)
def none(logp: Tensor, ref_logp: Tensor, rho: Tensor) -> Tensor:
    """No KL penalty.

    formula: 0
    source: DAPO, Dr. GRPO, CISPO (no reference model)
    shapes: -> [B, T]
    """
    return torch.zeros_like(logp)


@register("kl", needs=NEEDS, uses_ratio=False, roles=SCALE, beta=BETA, where=WHERE, aggregation=AGGREGATION, straight_through=STRAIGHT_THROUGH)
def k1(logp: Tensor, ref_logp: Tensor, rho: Tensor, straight_through: bool = False) -> Tensor:
    """The naive estimator (log ratio).

    formula: k1 = log pi - log pi_ref   (straight_through: k1 forward, k2's gradient backward)
    source: Schulman, "Approximating KL divergence" (2020); verl kl_penalty=kl/k1 (k1+ with
      straight_through); TRL RLOOTrainer (in the reward, summed over tokens)
    shapes: [B, T] -> [B, T]
    """
    k = logp - ref_logp
    return _straight_through(k, logp, ref_logp) if straight_through else k


@register("kl", needs=NEEDS, uses_ratio=False, roles=SCALE, beta=BETA, where=WHERE, aggregation=AGGREGATION)
def k2(logp: Tensor, ref_logp: Tensor, rho: Tensor) -> Tensor:
    """Half squared log ratio.

    formula: k2 = 0.5 (log pi - log pi_ref)^2
    source: Schulman 2020; verl kl_penalty=mse/k2
    shapes: [B, T] -> [B, T]
    """
    return 0.5 * (logp - ref_logp) ** 2


@register("kl", needs=NEEDS, uses_ratio="ratio_weighted", roles=SCALE, beta=BETA, where=WHERE, aggregation=AGGREGATION,
          clamp=Bool(False, "verl's clamps: exponent to [-20, 20], value to [-10, 10]"),
          ratio_weighted=Bool(False, "multiply by rho (TRL use_bias_correction_kl=True)"),
          straight_through=STRAIGHT_THROUGH)
def k3(logp: Tensor, ref_logp: Tensor, rho: Tensor, clamp: bool, ratio_weighted: bool,
       straight_through: bool = False) -> Tensor:
    """The unbiased low-variance estimator.

    formula: x = log pi_ref - log pi;  k3 = exp(x) - x - 1   (clamped if clamp; k2's gradient if straight_through; then times rho if ratio_weighted)
    source: GRPO (Shao et al. 2024, beta 0.04); Schulman 2020; verl kl_loss_type=low_var_kl
      (clamp=true; k3+ / low_var_kl+ add straight_through=true); TRL beta>0 (clamp=false,
      ratio_weighted=true by default)
    shapes: [B, T] -> [B, T]
    """
    x = ref_logp - logp
    if clamp:
        x = torch.clamp(x, -20.0, 20.0)
    k = torch.exp(x) - x - 1
    if clamp:
        k = torch.clamp(k, -10.0, 10.0)
    if straight_through:
        k = _straight_through(k, logp, ref_logp)
    if ratio_weighted:
        k = k * rho
    return k


@register("kl", "abs", needs=NEEDS, uses_ratio=False, roles=SCALE, beta=BETA, where=WHERE, aggregation=AGGREGATION, straight_through=STRAIGHT_THROUGH)
def abs_(logp: Tensor, ref_logp: Tensor, rho: Tensor, straight_through: bool = False) -> Tensor:
    """Absolute log ratio.

    formula: |log pi - log pi_ref|   (straight_through: this value forward, k2's gradient backward)
    source: verl kl_penalty=abs (abs+ with straight_through)
    shapes: [B, T] -> [B, T]
    edge cases: the gradient at log pi = log pi_ref is 0 (torch's sign(0)).
    """
    k = (logp - ref_logp).abs()
    return _straight_through(k, logp, ref_logp) if straight_through else k
