# MaxRL (Tajwar et al. 2026, arXiv 2602.02710): maximum-likelihood RL. Advantages are
# p-normalised, (r - p) / p with p the group's success rate, which weights hard prompts by
# 1/p (official compute_maxrl_outcome_advantage, eps 1e-6); PPO clip 0.2, token-mean loss and
# no KL as in the official Qwen3 script. Needs binary rewards.
algorithm maxrl extends grpo
  "p-normalised advantages (r - p) / p: RL that approaches maximum likelihood."
  rewards       binary
  normalizer    success_rate(eps=1e-6)
  kl            none
  aggregation   token_mean
