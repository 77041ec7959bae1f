algorithm demo
  "A formula test."
  define gate
    rho = 1.5
    w = min(rho, 1.2)
  end
  trust_region  gate
