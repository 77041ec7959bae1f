# GDPO (NVIDIA 2026, "Group reward-Decoupled Normalization Policy Optimization", arXiv
# 2601.05242): with several reward functions, normalise each function's reward within the
# prompt's group, sum them with the reward weights, then whiten the sum over the batch's
# response tokens -- verl adv_estimator=gdpo. TRL multi_objective_aggregation=
# "normalize_then_sum" is per_reward_group(eps=1e-4, singleton=zero, whiten=samples, whiten_eps=1e-4).
algorithm gdpo extends grpo
  "Each reward function normalised per group, weighted sum, whitened over the batch."
  baseline      per_reward_group
  normalizer    none
