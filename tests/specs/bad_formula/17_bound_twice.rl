algorithm demo
  "A formula test."
  define gate
    cap = 1.2
    w = min(rho, cap)
    w = max(rho, 0.8)
  end
  trust_region  gate
