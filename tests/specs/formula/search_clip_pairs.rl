# Clip bounds chosen per batch from candidate pairs (issue 47, item 2): the narrowest pair
# (low, high) of the list that clips at most `frac` of the batch's tokens, the widest when none
# does; then PPO's clip with that pair. Written by hand, this took one binding per candidate.
algorithm search_clip_pairs extends grpo
  "PPO clip whose bounds are the first candidate pair clipping at most frac of the batch's tokens."
  define searched_clip
    frac = 0.2
    low, high = first_of([(0.05, 0.08), (0.1, 0.15), (0.2, 0.28), (0.3, 0.4)], batch_mean(where(rho < 1 - low, 1, where(rho > 1 + high, 1, 0))) <= frac)
    w = where(A > 0, min(rho, 1 + high), max(rho, 1 - low))
  end
  trust_region  searched_clip
  kl            none
  aggregation   token_mean
