# GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): the ratio
# and its clip act on whole sequences, s_i = (pi/pi_old)^(1/|o_i|) (the geometric mean of the
# token ratios), clipped to [1 - 3e-4, 1 + 4e-4]; group-normalised advantages, each sequence's
# token mean then the mean over sequences, no KL. verl loss_mode=gspo (log s clamped at 10);
# TRL importance_sampling_level="sequence" with loss_type="grpo" (no clamp).
algorithm gspo extends grpo
  "Sequence-level importance ratio and clip: the geometric mean of the token ratios."
  ratio         sequence(clamp=10.0)
  trust_region  clip(low=0.0003, high=0.0004)
  kl            none
