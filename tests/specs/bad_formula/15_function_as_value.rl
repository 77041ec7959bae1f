algorithm demo
  "A formula test."
  define gate
    w = exp
  end
  trust_region  gate
