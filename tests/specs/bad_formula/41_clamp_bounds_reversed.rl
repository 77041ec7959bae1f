algorithm demo
  "A formula test."
  define gate
    w = clamp(rho, 1.2, 0.8)
  end
  trust_region  gate
