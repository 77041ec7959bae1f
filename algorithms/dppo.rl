# DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879): the
# trust region is a bound on the sampled token's probability change (Binary-TV, delta
# 0.15), blocking only moves in the advantage's direction; survey table: group (r-mean)/std,
# sample average. verl's example instead drops the std and uses token_sum_norm.
algorithm dppo extends grpo
  "Binary total-variation trust region on the sampled token's probability."
  trust_region  tv(low=0.15, high=0.15)
  kl            none
