algorithm demo
  "A formula test."
  define gate
    w = rho ** 2
  end
  trust_region  gate
