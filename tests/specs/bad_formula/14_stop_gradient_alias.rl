algorithm demo
  "A formula test."
  define gate
    w = stop_gradient(rho)
  end
  trust_region  gate
