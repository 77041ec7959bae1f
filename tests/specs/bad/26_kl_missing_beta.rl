algorithm demo
  "A test spec."
  kl            k3(where=loss)
