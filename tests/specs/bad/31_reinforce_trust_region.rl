algorithm demo
  "A test spec."
  objective     reinforce
  trust_region  clip
