algorithm demo
  "A formula test."
  define gate
    w = min(rho, 1.2)
  end
  define gate
    w = max(rho, 0.8)
  end
  trust_region  gate
