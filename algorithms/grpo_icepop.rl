# GRPO with IcePop (inclusionAI Ring team 2025, "Small Leak Can Sink a Great Ship: Boost RL
# Training on MoE with IcePop!", and the Ring-1T report, arXiv 2510.18855): tokens whose
# train/inference probability ratio pi_old / pi_rollout leaves the band [0.5, 5] get weight 0
# (they stay in the denominator); inside it the ratio is the token's weight. Band as verl's
# decoupled_token_icepop preset (rollout_is_threshold="0.5_5.0").
algorithm grpo_icepop extends grpo
  "GRPO with token importance weights pi_old / pi_rollout, masked to zero outside [0.5, 5]."
  correction    importance(level=token, mode=mask, low=0.5, high=5.0)
