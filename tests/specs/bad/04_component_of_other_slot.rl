algorithm demo
  "A test spec."
  baseline      group_mean
  normalizer    group_mean
