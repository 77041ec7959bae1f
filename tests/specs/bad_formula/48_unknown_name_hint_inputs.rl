algorithm demo
  "A formula test."
  define gate
    w = min(rho, cap)
  end
  trust_region  gate
