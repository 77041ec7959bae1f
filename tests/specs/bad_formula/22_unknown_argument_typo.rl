algorithm demo
  "A formula test."
  define gate
    high = 0.28
    w = min(rho, 1 + high)
  end
  trust_region  gate(hihg=0.3)
