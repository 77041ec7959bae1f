algorithm demo
  "A formula test."
  define gate
    weight = min(rho, 1.2)
  end
  trust_region  gate
