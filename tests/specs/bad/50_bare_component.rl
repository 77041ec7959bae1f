algorithm demo
  "A test spec."
  group_mean
