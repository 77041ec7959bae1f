algorithm demo
  "A formula test."
  define gate
    w = rho / mean(rho)
  end
  trust_region  gate
