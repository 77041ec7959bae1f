algorithm demo
  "A test spec."
  baseline      group_mean
  normalizer    success_rate
