# DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher (0.2 / 0.28), token-level loss,
# dynamic sampling (resample until groups have mixed outcomes; verl recipe caps at 10
# rounds), soft overlong punishment (L_max 20480, L_cache 4096), no KL.
algorithm dapo extends grpo
  "Clip-higher, token-level loss, dynamic sampling, soft overlong penalty, no KL."
  trust_region  clip(low=0.2, high=0.28)
  kl            none
  aggregation   token_mean
  sampling      dynamic(max_rounds=10)
  shaping       overlong_penalty(max_len=20480, cache=4096)
