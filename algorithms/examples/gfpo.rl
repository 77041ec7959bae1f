# GFPO (Shrivastava et al. 2025, Sample More to Think Less: Group Filtered Policy
# Optimization for Concise Reasoning, arXiv 2508.09726): sample a larger group, keep exactly
# k of its G answers by a metric -- here the k shortest (the paper's length filter; its token
# efficiency filter is group_topk_mask(r / max(L, 1), k)) -- and normalize their rewards
# with the retained answers' mean and std; the filtered-out answers get advantage 0. Ties
# (answers of the same length) are broken by position, the earlier answer kept, as a stable
# sort does: exactly k answers stay, also where a quantile cut would keep every tied one.
algorithm gfpo extends grpo
  "GRPO on the k shortest answers of each group: retained-set mean and std, 0 elsewhere."
  define gfpo_retain
    k = 2
    eps = 1e-6
    keep = group_topk_mask(-L, k)
    n = group_sum(where(keep, 1, 0))
    mu = group_sum(where(keep, r, 0)) / max(n, 1)
    sd = sqrt(group_sum(where(keep, (r - mu)^2, 0)) / max(n - 1, 1))
    A = where(keep, (r - mu) / (sd + eps), 0)
  end
  baseline      gfpo_retain
  normalizer    none
