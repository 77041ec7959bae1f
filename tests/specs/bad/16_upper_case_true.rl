algorithm demo
  "A test spec."
  normalizer    whiten(shift_mean=TRUE)
