algorithm demo
  "A formula test."
  define gate
    high = 0.28
    low = 0.2
    w = min(rho, 1 + high)
  end
  trust_region  gate
