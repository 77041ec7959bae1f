# Pass@k Training with analytical derivation (Chen et al. 2025, "Pass@k Training for Adaptively
# Balancing Exploration and Exploitation of Large Reasoning Models", arXiv 2508.10751; code
# github.com/RUCAIBox/Passk_Training, code/passk_adv.py calc_adv): the advantage of the group's
# pass@k reward in closed form. With n = G answers of which c are right (binary rewards):
# rho = 1 - C(n-c, k) / C(n, k), sigma = sqrt(rho (1 - rho)), a right answer gets
# (1 - rho) / (sigma + 1e-6), a wrong one (1 - rho - C(n-c-1, k-1) / C(n-1, k-1)) / (sigma + 1e-6)
# (a right answer whose value is 0 takes the wrong one's, as the authors' two np.where; a reward
# neither 0 nor 1 is its own advantage). The binomial ratios are products of k (and k - 1)
# factors, written out here for k = 4: another k is another product (the language has no
# binomial or lgamma); it needs G >= k. The authors release the advantage only; the loss is grpo's.
algorithm passk_training extends grpo
  "Closed-form advantage of the group's pass@k reward (k = 4), no baseline or std normalization."
  define passk_advantage
    eps = 1e-6
    n = G
    c = group_sum(where(r == 1, 1, 0))
    miss = (n - c) / n * (n - c - 1) / (n - 1) * (n - c - 2) / (n - 2) * (n - c - 3) / (n - 3)
    p = 1 - miss
    sigma = sqrt(p * (1 - p))
    blame = where(c < n, (n - c - 1) / (n - 1) * (n - c - 2) / (n - 2) * (n - c - 3) / (n - 3), 0)
    a_pos = (1 - p) / (sigma + eps)
    a_neg = (1 - p - blame) / (sigma + eps)
    A = where(r == 1, where(a_pos == 0, a_neg, a_pos), where(r == 0, a_neg, r))
  end
  baseline      passk_advantage
  normalizer    none
