algorithm demo
  "A formula test."
  define gate
    gap = rho - 1
    w = min(rho, 1.2)
  end
  trust_region  gate
