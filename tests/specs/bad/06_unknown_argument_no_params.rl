algorithm demo
  "A test spec."
  baseline      group_mean(eps=1e-6)
