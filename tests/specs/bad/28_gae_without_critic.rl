algorithm demo
  "A test spec."
  baseline      gae(lam=0.95)
