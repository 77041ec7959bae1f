# OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): the
# baseline that minimises gradient variance when the gradient norm grows with the length,
# b = sum L_j r_j / sum L_j over the group; strictly on-policy training (one update per
# rollout: the runtime default), no KL, no std. verl adv_estimator=opo.
algorithm opo extends grpo
  "Length-weighted group-mean baseline (the optimal baseline); on-policy, no KL."
  baseline      length_weighted_mean
  normalizer    none
  kl            none
  aggregation   token_mean
