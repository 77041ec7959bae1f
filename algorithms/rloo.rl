# RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019): the mean reward of the
# other G-1 samples as baseline, REINFORCE on whole sequences (no ratio clip), KL to the
# reference subtracted from the reward (TRL RLOOTrainer beta 0.05, k1 summed over tokens).
algorithm rloo
  "Leave-one-out baseline, sequence-level REINFORCE, KL in the reward."
  baseline      leave_one_out
  objective     reinforce
  kl            k1(beta=0.05, where=reward)
  aggregation   seq_mean_token_sum
