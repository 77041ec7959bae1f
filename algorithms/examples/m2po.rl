# M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale
# Data on LLMs?", arXiv 2510.01161; code github.com/Infini-AI-Lab/M2PO, verl core_algos.py
# kpo_clip_harmful_tokens / _solve_tau_from_sorted_delta2 / compute_m2po_policy_loss). A second-
# moment trust region: over the batch's "harmful" tokens (A > 0 with rho > 1, A < 0 with rho < 1)
# the squared log ratios d^2 are sorted; the first sorted index k whose capped sum
# (d^2_k - 1e-12) (n - k - 1) + sum_{j<=k} d^2_j reaches budget * n sets tau^2 = d^2_{k-1} - 1e-12
# (tau = 0 at k = 0), and the PPO clip bounds become rho in [min(exp(-tau), 0.7), max(exp(tau),
# 1.5)] (the authors' floors 0.3 / 0.5 on the clip ranges); no clip at all when the harmful tokens'
# mean d^2 is already within the budget (or there are none). Budget 0.04, GRPO advantages,
# token mean, no KL: the authors' scripts.
algorithm m2po extends grpo
  "PPO clip whose bounds cap the harmful tokens' second moment of log ratios at a budget."
  define second_moment_clip
    budget = 0.04
    tiny = 1e-12
    big = 1e30
    d2 = sg((logp - old_logp)^2)
    harm = where(A > tiny, where(rho > 1 + tiny, 1, 0), where(A < -tiny, where(rho < 1 - tiny, 1, 0), 0))
    n = batch_sum(harm)
    s = batch_sort(where(harm > 0, d2, big))
    j = batch_cumsum(mask) - 1
    c = batch_cumsum(where(j < n, s, 0))
    k = batch_min(where(j < n, where((s - tiny) * (n - j - 1) + c >= budget * n - tiny, j, big), big))
    prev = batch_sum(where(j == k - 1, s, 0))
    tau = where(k > 0, sqrt(max(prev - tiny, 0)), 0)
    m2 = batch_sum(where(harm > 0, d2, 0)) / max(n, 1)
    free = where(n > 0, where(m2 <= budget + tiny, 1, 0), 1)
    lo = where(free > 0, 0, min(exp(-tau), 0.7))
    hi = where(free > 0, 100000, max(exp(tau), 1.5))
    w = where(A >= 0, min(rho, hi), max(rho, lo))
  end
  trust_region  second_moment_clip
  kl            none
  aggregation   token_mean
