algorithm demo
  "A test spec."
  kl            k3(beta=0.04, where=los)
