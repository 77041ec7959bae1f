# GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673). The
# sequence's weight is the geometric mean of its token ratios, each clipped in log space in
# the direction of its advantage: exp(mean_t sgn(A) min(sgn(A) log rho_t, sgn(A) clip(log rho_t,
# -low, high))). A geometric mean is less sensitive to one outlying token than GRPO's
# arithmetic mean, so the clip range can be wider (low = high = 0.4 here, in log space).
# The loss is -A_i w_i per sequence, averaged over sequences (seq_mean_token_mean of a
# value constant along the sequence).
algorithm gmpo extends grpo
  "Geometric mean of sign-aware clipped token ratios, one weight per sequence."
  define geometric_clip
    low = 0.4
    high = 0.4
    log_rho = logp - old_logp
    s = sign(A)
    clipped = s * min(s * log_rho, s * clamp(log_rho, -low, high))
    w = exp(seq_mean(clipped))                       # [B]: one weight per sequence
  end
  trust_region  geometric_clip
  kl            none
  aggregation   seq_mean_token_mean
