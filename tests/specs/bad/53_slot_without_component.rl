algorithm demo
  "A test spec."
  baseline      group_mean
  kl
