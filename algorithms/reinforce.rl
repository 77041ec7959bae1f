# REINFORCE (Williams 1992): the plain policy gradient, -A log pi of the whole sequence,
# with a batch-mean reward baseline; no ratio, no trust region (survey table: "EMA or batch
# mean reward", sample average). verl: loss_mode=gpg + loss_agg_mode=seq-mean-token-sum.
algorithm reinforce
  "Policy gradient on sequence log-likelihoods with a batch-mean baseline."
  baseline      batch_mean
  objective     reinforce
  aggregation   seq_mean_token_sum
