algorithm demo
  "A formula test."
  define gate
    w = rho / 0
  end
  trust_region  gate
