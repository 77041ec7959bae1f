# KRPO (Wang et al. 2025, "Kalman Filter Enhanced Group Relative Policy Optimization for Language
# Model Reasoning", arXiv 2505.07527; code github.com/billhhh/KRPO_LLMs_RL, train.py KalmanFilter
# and group_advantages, loss.py GRPOLoss): a scalar Kalman filter runs over each group's rewards in
# row order (x = 0, P = 1 before the first; predict P + Q; gain K = (P + Q) / (P + Q + R); x += K
# (r - x); P = (1 - K)(P + Q)), and row j's advantage is (r_j - x_j) / (sqrt(P_j) + 1e-8) with the
# filter's state after row j. The gains do not depend on the rewards, so the recursion has a closed
# form: with d_j the denominator of the filter's Moebius map after j steps (d_0 = 1, in powers of the
# eigenvalues mu1, mu2 of its matrix divided by R), 1 - K_j = d_(j-1) / d_j, P_j = n_j / d_j and
# x_j = sum_(i <= j) (d_i - d_(i-1)) r_i / d_j (a group cumsum). Q = 1e-5, R = 1e-2 as the authors'
# train.py; the loss is theirs: PPO clip 0.2 on the unclamped ratio, k3 KL 0.01 in the loss, each
# answer's token mean, then the mean over answers.
algorithm krpo extends grpo
  "Group advantages against a Kalman filter's running estimate, scaled by its uncertainty."
  define abar(n, m1, m2) = (m1 ^ n - m2 ^ n) / (m1 - m2)
  define kalman_filter
    q = 0.00001
    rr = 0.01
    p0 = 1.0
    eps = 1e-8
    # j = 1, 2, ... in row order within the group, made float64 through lgamma (docs/formulas.md:
    # what follows lgamma stays float64): the closed form subtracts powers of mu = 1 +- 0.03, where
    # float32 loses 2e-6 of the advantage
    j = exp(lgamma(group_cumsum(1) + 1) - lgamma(group_cumsum(1)))
    root = sqrt(q * q + 4 * q * rr)
    mu1 = (q + 2 * rr + root) / (2 * rr)
    mu2 = (q + 2 * rr - root) / (2 * rr)
    d = abar(j, mu1, mu2) * (p0 + q + rr) / rr - abar(j - 1, mu1, mu2)
    d_prev = abar(j - 1, mu1, mu2) * (p0 + q + rr) / rr - abar(j - 2, mu1, mu2)
    n = abar(j, mu1, mu2) * (p0 + q) - abar(j - 1, mu1, mu2) * p0
    x = group_cumsum((d - d_prev) * r) / d
    A = (r - x) / (sqrt(n / d) + eps)
  end
  baseline      kalman_filter
  normalizer    none
  ratio         token(clamp=1000)
  kl            k3(beta=0.01, where=loss)
