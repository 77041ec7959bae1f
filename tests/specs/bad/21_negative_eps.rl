algorithm demo
  "A test spec."
  normalizer    group_std(eps=-1e-6)
