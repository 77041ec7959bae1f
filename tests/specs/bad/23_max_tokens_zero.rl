algorithm demo
  "A test spec."
  aggregation   token_sum_norm(max_tokens=0)
