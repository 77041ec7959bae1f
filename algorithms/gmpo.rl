# GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the sequence
# ratio is the geometric mean of the token ratios, each clipped in log space on the side its
# advantage pushes (A > 0: at +0.4, A < 0: at -0.4, the paper's (e^-0.4, e^0.4)); the loss is
# -mean_t(A) r_i averaged over every row, no KL. verl loss_mode=geo_mean (clip_ratio 0.4), with
# its optional +-20 log-ratio clamp turned on.
algorithm gmpo extends grpo
  "Geometric mean of sign-aware clipped token ratios: one ratio per sequence, robust to outliers."
  ratio         geo_mean(low=0.4, high=0.4, clamp=20.0)
  trust_region  none
  kl            none
  aggregation   seq_mean_token_mean(count_empty=true)
