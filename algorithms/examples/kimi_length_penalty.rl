# Kimi k1.5's length penalty (Kimi Team 2025, arXiv 2501.12599) on top of GRPO. Within
# each prompt's group, lambda = 0.5 - (len - min_len) / (max_len - min_len): a correct
# answer gets lambda (short ones gain, long ones lose), an incorrect one min(0, lambda)
# (long wrong answers are penalised, short ones not rewarded). It is added to the verifier's
# reward with a weight (the paper warms the penalty up; fixed here). When every answer of
# the group has the same length, lambda is 0 (our choice: the formula is 0 / 0 there).
algorithm kimi_length_penalty extends grpo
  "GRPO with Kimi k1.5's group-relative length penalty added to binary rewards."
  rewards       binary
  define length_penalty
    weight = 0.5
    shortest = group_min(L)
    spread = group_max(L) - shortest
    lam = where(spread > 0, 0.5 - (L - shortest) / max(spread, 1), 0)
    r = r + weight * where(r > 0, lam, min(lam, 0))
  end
  shaping       length_penalty
