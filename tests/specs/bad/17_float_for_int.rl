algorithm demo
  "A test spec."
  sampling      dynamic(max_rounds=2.5)
