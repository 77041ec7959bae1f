algorithm no_trailing_newline
  "The last line has no line end."
  baseline      group_mean
  aggregation   token_sum_norm(max_tokens=512)