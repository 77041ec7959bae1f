"""distill: a per-token divergence of the policy (the student) from a teacher model.

Signature: ``(logp [B, T], mask [B, T]) -> (d [B, T], metrics)``; each component also takes,
as keywords, the teacher's inputs it needs (``teacher_logp``, or ``teacher_topk_logp`` with
``topk_logp``, the policy's logprobs of the teacher's top-k tokens). The runtime parameters
shared by every component shape the generated loss (``rldsl explain --code``):

    d = clamp(d, -max_clamp, max_clamp)                      if max_clamp is set
    mode=supervised:       term_it = d_it                    (the divergence is minimised directly)
    mode=policy_gradient:  term_it = ppo(A_it = -sg(d_it))   (verl's vanilla PPO loss, its own clip)
    l_it = [l_task_it if task] + coef * term_it

``task=false`` drops the spec's policy loss of the task reward (distillation alone). The
sampled-token estimators are the ``kl`` slot's own functions with the teacher where the
reference goes (verl 0.9.1 ``distillation.distillation_loss.loss_mode`` k1/k2/k3/abs call
``core_algos.kl_penalty``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..registry import Bool, Choice, Float, Int, register
from . import kl

if TYPE_CHECKING:
    from torch import Tensor

_M = "distill/"

#: the runtime parameters every distill component takes (how its divergence enters the loss)
MODE = dict(
    mode=Choice(("supervised", "policy_gradient"), "supervised",
                "supervised: minimise d; policy_gradient: -d (no gradient) is each token's advantage in "
                "verl's vanilla PPO loss (verl use_policy_gradient)", runtime=True),
    coef=Float(1.0, "weight of the distillation term (verl distillation_loss_coef)", ge=0, runtime=True),
    task=Bool(True, "keep the spec's policy loss of the task reward (verl use_task_rewards)", runtime=True),
    max_clamp=Float(None, "d is clamped to [-max_clamp, max_clamp] (verl loss_max_clamp)", gt=0, runtime=True),
    clip_low=Float(0.2, "the ratio may fall to 1 - clip_low (verl clip_ratio_low)",
                   gt=0, lt=1, runtime=True, when=("mode", "policy_gradient")),
    clip_high=Float(0.2, "the ratio may rise to 1 + clip_high (verl clip_ratio_high)",
                    gt=0, runtime=True, when=("mode", "policy_gradient")),
    clip_c=Float(3.0, "dual-clip bound for negative advantages (verl's default 3.0)",
                 gt=1, runtime=True, when=("mode", "policy_gradient")),
)
SCALE = {"scale": "coef"}


def _valid_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask > 0, x, 0.0)).sum() / mask.sum().clamp(min=1.0)


def _valid_extreme(x: Tensor, mask: Tensor, fn: str) -> Tensor:
    fill = float("inf") if fn == "min" else -float("inf")
    out = getattr(torch.where(mask > 0, x, fill), "amin" if fn == "min" else "amax")()
    return torch.where(mask.sum() > 0, out, torch.zeros_like(out))


@register("distill", off=True)
def none(logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """No teacher.

    formula: 0
    source: -
    shapes: -> [B, T]
    """
    return torch.zeros_like(logp), {}


_ESTIMATORS = ("k1", "k2", "k3", "abs")


@register("distill", needs=("teacher_logprobs",), roles=SCALE,
          estimator=Choice(_ESTIMATORS, "k3", "the kl slot's estimator of KL(student ‖ teacher) on the sampled "
                                             "token (k3 with verl's clamps)"),
          **MODE)
def reverse_kl(logp: Tensor, mask: Tensor, teacher_logp: Tensor, estimator: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Reverse KL to the teacher, estimated on the sampled token (on-policy distillation).

    formula: d_it = {estimator}(log pi(o_it), log pi_teacher(o_it))   (the kl slot's estimator, teacher for reference; k3 clamped as verl)
    source: verl 0.9.1 distillation loss_mode=kl/k1, abs, mse/k2, low_var_kl/k3
      (compute_distillation_loss_reverse_kl_estimator: core_algos.kl_penalty(log_prob, teacher_logprobs));
      Thinking Machines "On-Policy Distillation" (k1 as a per-token advantage: mode=policy_gradient)
    shapes: [B, T] -> [B, T]
    edge cases: k1 with mode=supervised has a gradient that does not depend on the teacher (verl refuses it).
    """
    rho = torch.ones_like(logp)
    if estimator == "k1":
        d = kl.k1(logp, teacher_logp, rho)
    elif estimator == "k2":
        d = kl.k2(logp, teacher_logp, rho)
    elif estimator == "k3":
        d = kl.k3(logp, teacher_logp, rho, clamp=True, ratio_weighted=False)
    else:
        d = kl.abs_(logp, teacher_logp, rho)
    return d, {_M + "abs_divergence": _valid_mean(d.detach().abs(), mask)}


@register("distill", needs=("teacher_topk_logprobs", "topk_logprobs"), roles=SCALE,
          plan={"teacher_topk": "k"},
          k=Int(32, "the teacher's top-k tokens per position (verl distillation_loss.topk)", ge=1, runtime=True),
          log_prob_min_clamp=Float(None, "both sides' top-k logprobs are clamped below at it (verl "
                                         "log_prob_min_clamp)"),
          **MODE)
def forward_kl_topk(logp: Tensor, mask: Tensor, teacher_topk_logp: Tensor, topk_logp: Tensor,
                    log_prob_min_clamp: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward KL(teacher ‖ student) over the teacher's top-k tokens, clamped at 0.

    formula: d_it = max(0, sum_j p_T(j) (log p_T(j) - log p_S(j))),  j over the teacher's top-{k} tokens at t  (both log p clamped below at log_prob_min_clamp when set)
    source: verl 0.9.1 distillation loss_mode=forward_kl_topk (fsdp compute_forward_kl_topk; the clamp
      at 0 and the student/teacher mass metrics of losses.compute_forward_kl_topk); MiniLLM-style
      supervised distillation (mode=supervised)
    shapes: [B, T, J] -> [B, T]
    edge cases: the top-k masses do not sum to 1, so the sum can be negative: it is clamped at 0
      (verl). The masses are taken before log_prob_min_clamp.
    """
    student_mass = topk_logp.detach().exp().sum(-1)  # [B, T]
    teacher_mass = teacher_topk_logp.exp().sum(-1)
    s, t = topk_logp, teacher_topk_logp
    if log_prob_min_clamp is not None:
        s = s.clamp_min(log_prob_min_clamp)
        t = t.clamp_min(log_prob_min_clamp)
    d = (t.exp() * (t - s)).sum(-1).clamp_min(0.0)
    metrics = {}
    for name, m in (("student_mass", student_mass), ("teacher_mass", teacher_mass)):
        metrics[_M + name] = _valid_mean(m, mask)
        metrics[_M + name + "_min"] = _valid_extreme(m, mask, "min")
        metrics[_M + name + "_max"] = _valid_extreme(m, mask, "max")
    return d, metrics


@register("distill", needs=("divergence",), roles=SCALE, plan={"jsd_beta": "beta", "jsd_temperature": "temperature"},
          beta=Float(0.5, "0 = forward KL(teacher ‖ student), 1 = reverse KL(student ‖ teacher), between: the "
                          "JSD of the mixture (1 - beta) p_S + beta p_T (TRL DistillationConfig beta)",
                     ge=0, le=1, runtime=True),
          temperature=Float(1.0, "both models' logits are divided by it (TRL DistillationConfig temperature)",
                            gt=0, runtime=True),
          **MODE)
def jsd(logp: Tensor, mask: Tensor, jsd: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Generalized Jensen-Shannon divergence over the whole vocabulary (GKD).

    formula: d_it = {beta} KL(p_T ‖ m) + (1 - {beta}) KL(p_S ‖ m),  m = (1 - {beta}) p_S + {beta} p_T  (beta 0: KL(p_T ‖ p_S); beta 1: KL(p_S ‖ p_T)); logits / {temperature}
    source: TRL 1.16 DistillationTrainer (_chunked_divergence_loss: beta, temperature); GKD (Agarwal et
      al. 2024). The divergence is :func:`generalized_jsd_of_logits`; the runtime runs it over the
      vocabulary in chunks of tokens (runtime/train/divergence.py) and hands d_it in as ``jsd``
    shapes: [B, T] -> [B, T]
    """
    return jsd, {}


def check_beta(beta: float) -> float:
    """``beta`` as a float in [0, 1], or a ValueError saying what it means."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    return float(beta)


def generalized_jsd_of_logits(z_s: Tensor, z_t: Tensor, beta: float) -> Tensor:
    """The ``jsd`` component's divergence per row of the student's and the teacher's logits
    z_s, z_t [n, V] (temperature already applied) -> [n]:

        beta = 0:      D = KL(p_T || p_S)                           (forward KL)
        beta = 1:      D = KL(p_S || p_T)                           (reverse KL)
        0 < beta < 1:  D = beta KL(p_T || m) + (1 - beta) KL(p_S || m),   m = (1 - beta) p_S + beta p_T

    with p = softmax(z); log m by logaddexp (no underflow of the mixture). TRL 1.16
    ``DistillationTrainer`` (``_chunked_divergence_loss``): the same three cases and mixture.
    """
    beta = check_beta(beta)
    log_s = torch.log_softmax(z_s, dim=-1)
    log_t = torch.log_softmax(z_t, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float,
                    temperature: float = 1.0) -> Tensor:
    """Naive: D per token from the full logits [..., V] of both models, both divided by the
    temperature -> [...] (the reference the chunked runtime computation is tested against)."""
    return generalized_jsd_of_logits(student_logits / temperature, teacher_logits / temperature, beta)
