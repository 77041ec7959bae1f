algorithm my_dr_grpo extends grpo
  normalizer    none
  aggregation   token_sum_norm
