algorithm demo
  "A test spec."
  normalizer    group_std(unbiased=1)
