# DCPO's dynamic adaptive clipping (Yang et al. 2025, "DCPO: Dynamic Clipping Policy
# Optimization", arXiv 2509.02333; code github.com/lime-RL/DCPO, verl core_algos.py
# get_clip_low_high and compute_policy_loss_dcpo clip_type="dynamic"): the clip bounds of each
# token follow its old probability q = pi_old(o_t): 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0)) <=
# rho <= min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), max(c, 10)), a rare token gets a wider range;
# then verl's dual clip (c = 3) and a token mean. eps_low 0.16, eps_high 0.2 as the paper.
# Its advantage here is GRPO's (dapo's). DCPO whole, with its smooth advantage standardization
# (per prompt, the mean and std of every step's rewards for that prompt mixed with this step's,
# 1/(n+1) weights, the smaller of two mixtures; read from the per-prompt statistics across steps),
# is dcpo_sas.rl, with this loss unchanged (docs/new_algorithms.md).
algorithm dcpo extends dapo
  "Token clip bounds from the old probability (dynamic adaptive clipping), dual clip, token mean."
  define dynamic_adaptive_clip
    eps_low = 0.16
    eps_high = 0.2
    c = 3.0
    q = exp(old_logp)
    lo = (1 + sqrt(max(1 - 4 * eps_low / q, 0))) / 2
    hi = min((1 + sqrt(1 + 4 * eps_high / q)) / 2, max(c, 10))
    l0 = max(-A * rho, -A * clamp(rho, lo, hi))
    l = where(A < 0, min(-A * c, l0), l0)
  end
  shaping       none
  trust_region  none
  objective     dynamic_adaptive_clip
