algorithm demo
  "A test spec."
  filter        zero_variance,
