# A trust region whose bound comes from the sorted per-token divergences of the whole batch:
# sort v = |log pi - log pi_old| ascending over every valid token, accumulate until the share
# `budget` of the batch's total divergence is met; the value there is the bound. Tokens above
# it keep their ratio's value but lose its gradient.
algorithm order_budget_trust_region extends grpo
  "PPO objective; tokens beyond the batch's divergence budget get no gradient."
  define budget_bound
    budget = 0.6
    v = sg(abs(logp - old_logp))
    s = batch_sort(v)
    c = batch_cumsum(s)
    bound = batch_min(where(c >= budget * batch_sum(v), s, batch_max(v)))
    w = where(v <= bound, rho, sg(rho))
  end
  trust_region  budget_bound
  kl            none
  aggregation   token_mean
