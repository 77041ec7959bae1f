# ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE whose baseline is the reward of a
# greedy (temperature 0) response to the same prompt, generated and scored by the runtime
# each step; A_t = (reward-to-go) - r_greedy on every token, not whitened (verl
# adv_estimator=remax). KL k1 in the reward, beta 0.001, token-mean loss: verl's ReMax example.
algorithm remax extends grpo
  "Greedy-rollout reward as the baseline (one extra greedy generation per prompt)."
  baseline      greedy_reward
  normalizer    none
  kl            k1(beta=0.001, where=reward)
  aggregation   token_mean
