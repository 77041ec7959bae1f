algorithm demo
  "A test spec."
  entropy       bonus(coef=1e400)
