# REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): for outcome rewards, subtract the group's
# mean reward, then whiten over all response tokens of the batch (not per group: no 1/std_g
# blow-up on easy prompts); PPO clip 0.2, k2 KL in the loss (beta 0.001), token-level loss.
# verl adv_estimator=reinforce_plus_plus_baseline and its example (kl_loss_type=mse).
algorithm reinforce_pp_baseline extends grpo
  "Group-mean baseline, whitened over the batch's tokens; k2 KL in the loss."
  baseline      group_mean(singleton=reward)
  normalizer    whiten
  kl            k2(beta=0.001, where=loss)
  aggregation   token_mean
