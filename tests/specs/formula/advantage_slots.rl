# Every advantage-stage slot as a formula: two shapings (one after a registry component),
# a leave-one-out baseline, a batch-std normalizer and a length filter.
algorithm advantage_slots
  "Formulas in shaping, baseline, normalizer and filter."
  define length_bonus
    scale = 0.01
    r = r - scale * L / T
  end
  define clip_reward
    r = clamp(r, -1, 1)
  end
  define loo
    K = group_sum(1)
    A = where(K > 1, (r - group_mean(r)) * K / max(K - 1, 1), r)
  end
  define batch_scale
    eps = 1e-4
    A = A / (batch_std(r) + eps)
  end
  define not_too_long
    limit = 4096
    keep = L <= limit
  end
  shaping       length_bonus, overlong_penalty(max_len=64, cache=8), clip_reward
  baseline      loo
  normalizer    batch_scale
  filter        zero_variance, not_too_long
