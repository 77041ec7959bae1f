# REINFORCE++ (Hu 2025, arXiv 2501.03262): PPO's stabilisers without a critic -- a k1 KL
# penalty on every token's reward, the discounted return-to-go of those token rewards
# (gamma 1), whitened over all response tokens of the batch, PPO clip 0.2, token-level loss.
# verl adv_estimator=reinforce_plus_plus; beta 0.01 as OpenRLHF's init_kl_coef.
algorithm reinforce_pp extends grpo
  "Critic-free PPO on KL-shaped token returns, whitened over the batch."
  baseline      return_to_go(gamma=1.0)
  normalizer    whiten
  kl            k1(beta=0.01, where=reward)
  aggregation   token_mean
