# grpo (algorithms/grpo.rl) with every loss and advantage piece written as a formula: the
# same values and gradients as the registry spec (tests/formula), and the formula row of
# bench/loss.py.
algorithm grpo_formulas
  "GRPO, every piece a formula."
  define group_baseline
    b = group_mean(r)
  end
  define std_scale
    eps = 1e-6
    A = A / (group_std(r) + eps)
  end
  define token_ratio
    limit = 20.0
    log_rho = clamp(logp - old_logp, -limit, limit)
  end
  define ppo_clip
    low = 0.2
    high = 0.2
    w = where(A >= 0, min(rho, 1 + high), max(rho, 1 - low))
  end
  define surrogate
    l = -A * w
  end
  define k3_kl
    beta = 0.04
    x = ref_logp - logp
    kl = exp(x) - x - 1
  end
  define seq_token_mean
    weights = mask / max(L, 1)
    count = batch_sum(1)
  end
  baseline      group_baseline
  normalizer    std_scale
  ratio         token_ratio
  trust_region  ppo_clip
  objective     surrogate
  kl            k3_kl
  aggregation   seq_token_mean
