algorithm demo
  "A test spec."
  baseline      gae(gamma=1.0, lam=1.5)
  critic        value
