# PPO (Schulman et al. 2017, arXiv 1707.06347) as used for RLHF (Ouyang et al. 2022):
# GAE advantages from a learned critic, whitened over the batch's tokens; symmetric ratio
# clip 0.2; KL to the reference policy as a per-token reward penalty (k1).
algorithm ppo
  "Clipped surrogate on GAE advantages from a critic; KL penalty in the reward."
  baseline      gae(gamma=1.0, lam=0.95)
  normalizer    whiten
  critic        value(clip=0.5)
  objective     ppo
  trust_region  clip(low=0.2, high=0.2)
  kl            k1(beta=0.02, where=reward)
  aggregation   seq_mean_token_mean
