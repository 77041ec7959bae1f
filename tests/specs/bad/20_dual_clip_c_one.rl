algorithm demo
  "A test spec."
  trust_region  dual_clip(c=1)
