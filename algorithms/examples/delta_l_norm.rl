# Delta-L Normalization (He et al. 2025, "Delta L Normalization: Rethink Loss Aggregation in RLVR",
# arXiv 2509.07558; code github.com/zerolllin/Delta-L-Normalization, verl core_algos.py
# compute_grpo_outcome_advantage use_grpopp and compute_policy_loss masked_mean_allavg): each
# sample's GRPO advantage is scaled by w_i / mean_j w_j with w_i = (L_i / mean_j L_j)^(-alpha)
# (the batch's lengths), and the loss is the sum over tokens divided by B * T -- an unbiased,
# minimum-variance combination of the per-sample gradients. alpha = 0.75 as the authors' math
# run; DAPO otherwise (clip 0.2 / 0.3, dual clip c = 10, no KL, overlong buffer off). An empty
# response (L = 0, where the authors' code divides by zero) counts as L = 1.
algorithm delta_l_norm extends dapo
  "GRPO advantages scaled by normalized L^-alpha weights; loss summed over tokens / (B * T)."
  define delta_l_scale
    eps = 1e-6
    alpha = 0.75
    v = (max(L, 1) / batch_mean(L)) ^ (-alpha)
    A = A / (group_std(r) + eps) * v / batch_mean(v)
  end
  define all_token_mean
    weights = mask
    count = B * T
  end
  shaping       none
  normalizer    delta_l_scale
  trust_region  dual_clip(low=0.2, high=0.3, c=10.0)
  aggregation   all_token_mean
