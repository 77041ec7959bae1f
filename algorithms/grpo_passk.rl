# GRPO for pass@k (verl adv_estimator=grpo_passk, citing arXiv 2503.19595): only each group's
# best sample is reinforced, by its margin over the second best (the leave-one-out gradient
# of the group's maximum reward), divided by the group's reward std as in verl's default
# norm_adv_by_std_in_grpo=True. Needs rollout.n >= 2. verl's defaults: no KL, token-mean.
algorithm grpo_passk extends grpo
  "Pass@k training: the best sample of each group gets r_max - r_2nd, the others 0."
  baseline      leave_one_out_max
  kl            none
  aggregation   token_mean
