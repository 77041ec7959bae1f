algorithm demo
  "A formula test."
  define gate
    eps = 0.1
    A = A / (batch_std(r) + eps)
  end
  normalizer  gate(eps=1e999)
