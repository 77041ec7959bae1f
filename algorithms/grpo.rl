# GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): the critic replaced by a
# group-relative baseline (r - mean_g) / std_g over G samples per prompt; PPO clip 0.2;
# k3 KL to the reference in the loss (beta 0.04); each sequence's token mean, then the mean
# over sequences. The paper gives no std epsilon; 1e-6 as verl and ROLL.
algorithm grpo
  "Group-relative advantages (r - mean) / std, PPO clip, k3 KL in the loss."
  baseline      group_mean
  normalizer    group_std(eps=1e-6)
  objective     ppo
  trust_region  clip(low=0.2, high=0.2)
  kl            k3(beta=0.04, where=loss)
  aggregation   seq_mean_token_mean
