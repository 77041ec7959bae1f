# TOPR: Tapered Off-Policy REINFORCE (Le Roux, Bellemare et al. 2025, arXiv 2503.14286).
# Positive trajectories get the plain REINFORCE (SFT-like) gradient, with no importance
# weight; negative ones a truncated importance weight of the whole trajectory,
# sg(clip(pi(tau) / mu(tau), 0, 1)), so that pushing down an unlikely wrong answer stops once
# it is unlikely. mu is the rollout-time policy (pi_old). Rewards are +1 / -1 (the verifier's
# 0 / 1 mapped by a shaping formula), no baseline, no KL; the trajectory's log-likelihood is
# summed over its tokens.
algorithm topr
  "Tapered off-policy REINFORCE: SFT on positives, truncated trajectory IS on negatives."
  rewards       binary
  define plus_minus_one
    r = 2 * r - 1
  end
  define tapered_is
    seq_log_ratio = seq_sum(sg(logp - old_logp))    # log pi(tau) / mu(tau)   [B]
    taper = exp(min(seq_log_ratio, 0))              # clip(pi/mu, 0, 1), without overflow
    l = -where(A >= 0, 1, taper) * A * logp
  end
  shaping       plus_minus_one
  baseline      none
  objective     tapered_is
  aggregation   seq_mean_token_sum
