algorithm demo
  "A formula test."
  define gate
    w = exp(rho, 2)
  end
  trust_region  gate
