algorithm demo
  "A test spec."
  trust_region  clip(low=0.2,
                     high=0.28)
