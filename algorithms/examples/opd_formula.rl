# On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Thinking Machines 2025)
# written as a formula: minus the sampled-token reverse KL to the
# teacher (log pi_teacher - log pi, no gradient) is each token's advantage, through verl's
# dual-clip PPO loss (clip 0.2, c = 3); no task reward. Equal to the library's opd.rl (its
# `distill reverse_kl(estimator=k1, mode=policy_gradient, task=false)`), value and gradient.
# A run needs teacher.path (docs/distillation.md).
algorithm opd_formula extends grpo
  "On-policy distillation as a formula: A_t = log pi_teacher - log pi through a dual-clip PPO loss."
  define opd_pg
    c = 3.0
    A_d = sg(teacher_logp - logp)
    clipped = max(-rho * A_d, -clamp(rho, 0.8, 1.2) * A_d)
    l = where(A_d < 0, min(clipped, -c * A_d), clipped)
  end
  objective     opd_pg
  trust_region  none
  kl            none
  aggregation   token_mean
