# Lite PPO (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
# arXiv 2508.08221): just two tricks on critic-free PPO -- group-mean baseline with the
# std taken over the whole batch, and a token-level loss. Clip 0.2, no KL (ROLL:
# norm_mean_type=group, norm_std_type=batch, loss_agg_mode=token-mean).
algorithm lite_ppo
  "Group-mean advantages scaled by the batch std; token-level PPO clip loss."
  baseline      group_mean
  normalizer    batch_std(eps=1e-6)
  objective     ppo
  trust_region  clip(low=0.2, high=0.2)
  aggregation   token_mean
