# BNPO (Xiao et al. 2025, "BNPO: Beta Normalization Policy Optimization", arXiv 2506.02864; code
# github.com/changyi7231/BNPO, recipe/bnpo/src/bnpo_ray_trainer.py compute_bnpo_outcome_advantage):
# the advantage r - p (p the group's mean reward) divided by the density of a Beta(alpha, beta) at
# p, whose parameters follow the batch: with m and v the mean and variance (Bessel's, over the
# prompts) of the groups' p, a = (m (1 - m) / v - 1) m, b = (m (1 - m) / v - 1) (1 - m),
# alpha = max(1 + a / 3, 1), beta = max(1 + b / 3, 1); the weight 1 / density is capped at 1e6.
# A group all right or all wrong has r = p: advantage 0. The loss is the authors' recipe/bnpo/run.sh:
# clip 0.2 / 0.28 on the unclamped ratio, dual clip c = 10, no KL, no entropy,
# seq-mean-token-sum (each answer's token sum, averaged over every row).
algorithm bnpo extends grpo
  "Advantage r - p over the Beta density at the group's success rate p, Beta fitted to the batch."
  define log_beta(a, b) = lgamma(a) + lgamma(b) - lgamma(a + b)
  define beta_log_density(x, a, b) = (a - 1) * log(x) + (b - 1) * log(1 - x) - log_beta(a, b)
  define beta_normalized
    cap = 1000000.0
    p = group_mean(r)
    n = B / G                                        # prompts in the batch
    m = where(n > 1, batch_mean(p), 0)
    v = where(n > 1, batch_std(p) ^ 2 * (B - 1) / B * n / max(n - 1, 1), 1)
    k = m * (1 - m) / v - 1
    alpha = max(1 + k * m / 3, 1)
    beta = max(1 + k * (1 - m) / 3, 1)
    q = clamp(p, 0.000001, 0.999999)                 # the density is only read where 0 < p < 1
    w = min(exp(-beta_log_density(q, alpha, beta)), cap)
    A = where(p > 0, where(p < 1, w * (r - p), 0), 0)
  end
  baseline      beta_normalized
  normalizer    none
  ratio         token(clamp=1000)
  trust_region  dual_clip(low=0.2, high=0.28, c=10.0)
  kl            none
  aggregation   seq_mean_token_sum(count_empty=true)
