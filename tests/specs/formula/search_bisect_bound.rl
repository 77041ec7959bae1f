# A bound found by bisection (issue 47, item 2): eps is the smallest value in (0, max v] such
# that at most `frac` of the batch's tokens have v = |log pi - log pi_old| above it, to
# max(v) / 2^30; tokens above eps keep their ratio's value but lose its gradient.
algorithm search_bisect_bound extends grpo
  "PPO objective; tokens whose divergence lies above a bound bisected per batch get no gradient."
  define bisected_bound
    frac = 0.25
    v = sg(abs(logp - old_logp))
    eps = bisect(0, batch_max(v), 30, batch_mean(where(v > eps, 1, 0)) <= frac)
    w = where(v <= eps, rho, sg(rho))
  end
  trust_region  bisected_bound
  kl            none
  aggregation   token_mean
