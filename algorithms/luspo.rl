# LUSPO (Liu et al. 2026, "Length-Unbiased Sequence Policy Optimization", arXiv 2602.05261):
# GSPO whose per-sequence loss is scaled by the sequence's length, which removes GSPO's bias
# towards short responses: the token sum of each sequence, then the mean over all sequences.
# TRL loss_type="luspo" with importance_sampling_level="sequence" (TRL does not clamp log s).
algorithm luspo extends gspo
  "GSPO with each sequence's loss scaled by its length (token sum, mean over sequences)."
  aggregation   seq_mean_token_sum(count_empty=true)
