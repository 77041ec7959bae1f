algorithm demo
  "A test spec."
  baseline      os.system
