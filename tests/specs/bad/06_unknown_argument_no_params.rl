algorithm demo
  "A test spec."
  baseline      batch_mean(eps=1e-6)
