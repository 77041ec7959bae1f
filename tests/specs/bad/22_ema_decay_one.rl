algorithm demo
  "A test spec."
  baseline      ema(decay=1)
