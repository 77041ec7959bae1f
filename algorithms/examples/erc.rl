# Entropy-Ratio Clipping on DAPO (Su et al. 2025, "Entropy Ratio Clipping as a Soft Global
# Constraint for Stable Reinforcement Learning", arXiv 2512.05591; code: github.com/Kwai-Klear/ERC,
# verl policy_loss grpo_erc). Per token, the entropy ratio q = H_theta / H_old of the current
# policy's entropy to the old policy's (the one that made the old logprobs); a token whose q
# leaves (low, high) keeps its loss value but loses its gradient -- on top of PPO's clip
# (dual clip, c = 10 as the authors' runs). Bounds 0.8 / 1.2 are the authors' settings.
algorithm erc extends dapo
  "DAPO whose tokens lose their gradient where the entropy ratio to the old policy leaves (0.8, 1.2)."
  define entropy_ratio_clip
    low = 0.8
    high = 1.2
    q = (ent + 0.00000001) / (old_ent + 0.00000001)
    l0 = -w * A
    l = where(q > low, where(q < high, l0, sg(l0)), sg(l0))
  end
  trust_region  dual_clip(low=0.2, high=0.28, c=10.0)
  objective     entropy_ratio_clip
