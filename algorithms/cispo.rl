# CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update: every
# token keeps its gradient, -sg(min(rho, 1+eps_high)) A log pi. Only the upper bound is
# used (the lower one is set out of reach); the paper does not publish eps_high, we take
# verl's example (clip_ratio_high 0.2 -> cap 1.2). Token-level loss, no KL.
algorithm cispo extends grpo
  "Truncated, stop-gradient importance weights on -A log pi; token-level loss."
  objective     is_weighted
  trust_region  truncate(high=0.2)
  kl            none
  aggregation   token_mean
