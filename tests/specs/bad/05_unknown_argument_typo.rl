algorithm demo
  "A test spec."
  trust_region  clip(lo=0.2, high=0.28)
