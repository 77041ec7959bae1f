algorithm demo
  "A formula test."
  define gate
    w = min(rho, 1e400)
  end
  trust_region  gate
