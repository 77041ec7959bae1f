# BAPO (Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced
# Policy Optimization with Adaptive Clipping", arXiv 2510.18927; code github.com/WooooDyy/BAPO,
# recipe/bapo/policy_loss.py compute_policy_loss_bapo): the clip bounds (explicit ratio bounds
# low, high) are searched per batch: from (0.8, 1.2) the lower bound rises by 0.05 up to 0.95,
# then the upper one by 0.1 up to 2.0, until the positive-advantage tokens' share of the clipped
# surrogate, sum max(A w, 0) / (sum max(-A w, 0) + 1e-8), reaches 0.5 (true when nothing is
# negative); the last pair when none does. Then PPO's clip with those bounds, dual clip c = 3,
# token mean, GRPO advantages, no KL -- the authors' run_bapo_example.sh settings. The search is
# one first_of over the 12 pairs the authors' two loops visit, in their order.
algorithm bapo extends grpo
  "PPO clip whose bounds are searched per batch until positive tokens carry half the surrogate."
  define balanced_clip
    target = 0.5
    eps = 1e-8
    c = 3.0
    low, high = first_of([(0.8, 1.2), (0.85, 1.2), (0.9, 1.2), (0.95, 1.2), (0.95, 1.3), (0.95, 1.4), (0.95, 1.5), (0.95, 1.6), (0.95, 1.7), (0.95, 1.8), (0.95, 1.9), (0.95, 2.0)], where(batch_sum(max(-A * where(A >= 0, min(rho, high), max(rho, low)), 0)) > 0, batch_sum(max(A * where(A >= 0, min(rho, high), max(rho, low)), 0)) / (batch_sum(max(-A * where(A >= 0, min(rho, high), max(rho, low)), 0)) + eps), target) >= target)
    l0 = max(-A * rho, -A * clamp(rho, low, high))
    l = where(A < 0, min(-A * c, l0), l0)
  end
  trust_region  none
  objective     balanced_clip
  kl            none
  aggregation   token_mean
