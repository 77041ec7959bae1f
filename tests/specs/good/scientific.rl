# numbers in every form SIGNED_NUMBER accepts: exponents, a leading '.', a trailing '.', a '+'
algorithm scientific
  "Scientific notation and other number forms."
  baseline      group_mean
  normalizer    group_std(eps=1E-8)
  trust_region  clip(low=2e-1, high=.28)
  kl            k3(beta=4e-2, where=loss)
  entropy       bonus(coef=1.5e-3)
  ratio         token(clamp=20.)
  sampling      dynamic(max_rounds=+5)
  aggregation   token_sum_norm(max_tokens=4096)
