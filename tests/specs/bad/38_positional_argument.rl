algorithm demo
  "A test spec."
  trust_region  clip(0.2)
