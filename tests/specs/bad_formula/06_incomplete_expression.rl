algorithm demo
  "A formula test."
  define gate
    w = rho *
  end
  trust_region  gate
