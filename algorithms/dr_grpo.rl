# Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783):
# GRPO without its two biases -- no division by the group std, no 1/|o_i| length
# normalisation (token sum over a constant budget) -- and no KL term.
# max_tokens is the generation budget: set it to your max_new_tokens.
algorithm dr_grpo extends grpo
  "GRPO done right: r - mean, token sum over a constant length budget, no KL."
  normalizer    none
  kl            none
  aggregation   token_sum_norm(max_tokens=4096)
