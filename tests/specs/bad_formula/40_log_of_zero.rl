algorithm demo
  "A formula test."
  define gate
    w = rho * log(0)
  end
  trust_region  gate
