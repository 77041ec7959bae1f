# Every loss-stage slot as a formula, with the reductions over tokens, groups and the batch
# (quantiles included) and the scalars G, B and T.
algorithm loss_slots extends grpo
  "Formulas in ratio, trust region, objective, KL, entropy and aggregation."
  define geo_ratio
    log_rho = seq_mean(logp - old_logp) + logp - sg(logp)
  end
  define soft_clip
    tau = 2.0
    w = where(A >= 0, min(rho, 1 + tanh(tau * (rho - 1)) / tau), rho)
  end
  define tapered
    cap = batch_quantile(sg(rho), 0.9)
    l = -A * min(w, max(cap, 1)) * where(seq_max(logp) > log(0.5), 1, 0.5)
  end
  define half_k2
    beta = 0.01
    d = logp - ref_logp
    kl = 0.5 * d ^ 2 / G
  end
  define entropy_floor
    coef = 0.001
    floor = seq_quantile(sg(ent), 0.25)
    term = -coef * max(ent - floor, 0) * (1 + seq_std(ent) * 0)
  end
  define group_token_mean
    weights = mask / max(group_sum(L), 1) * group_sum(1)
    count = batch_sum(1) + 0 * B * T
  end
  ratio         geo_ratio
  trust_region  soft_clip
  objective     tapered
  kl            half_k2
  entropy       entropy_floor
  aggregation   group_token_mean
