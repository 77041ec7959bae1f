algorithm demo
  "A test spec."
  ratio         sequence
  trust_region  tv(low=0.1, high=0.1)
